// The explorer page: reads the JSON in #explorer-data (npformer/explore/collect.py writes it) and draws
// P, dL/dP and dL/dS of the chosen step, example, attention kind, layer and head, the readout of the
// hovered cell, and the training curves with the current step marked. Plain JavaScript, no library.
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("explorer-data").textContent);
  const DIGITS = DATA.digits;
  const CELL = 26, LEFT = 46, TOP = 34;      // map geometry in CSS pixels (also on each canvas as data-*)
  const MASKED_FILL = "#d4d4d4", MASKED_HATCH = "#9a9a9a";
  const $ = (id) => document.getElementById(id);
  const state = { step: 0, example: 0, kind: DATA.kinds[0].name, layer: 0, head: 0, cell: null };
  const decoded = new Map();   // "snapshot/example/array/kind/layer" -> Float32Array

  // base64 float32 little-endian -> Float32Array (exact: what the run recorded)
  function decodeArray(text) {
    const bytes = Uint8Array.from(atob(text), (c) => c.charCodeAt(0));
    const view = new DataView(bytes.buffer), out = new Float32Array(bytes.length / 4);
    for (let i = 0; i < out.length; i++) out[i] = view.getFloat32(4 * i, true);
    return out;
  }

  function fmt(x) {
    if (!Number.isFinite(x)) return String(x);
    return x === 0 ? "0" : x.toPrecision(DIGITS);
  }

  function kindInfo() { return DATA.kinds.find((k) => k.name === state.kind); }

  // the current head's P and dL/dP (Tq x Tk, float64 numbers from the float32 data), the mask, r and dL/dS
  function current() {
    const info = kindInfo(), example = DATA.examples[state.example];
    const queries = example[info.query], keys = example[info.key];
    const tq = queries.length, tk = keys.length, size = tq * tk;
    const snap = DATA.snapshots[state.step].examples[state.example];
    const arrays = {};
    for (const name of ["P", "dLdP"]) {
      const key = [state.step, state.example, name, state.kind, state.layer].join("/");
      if (!decoded.has(key)) decoded.set(key, decodeArray(snap[name][state.kind][state.layer]));
      arrays[name] = Array.from(decoded.get(key).subarray(state.head * size, (state.head + 1) * size));
    }
    const masked = example.masks[state.kind];
    const rowsum = [], dLdS = new Array(size);
    for (let i = 0; i < tq; i++) {
      let r = 0;
      for (let k = 0; k < tk; k++) r += arrays.P[i * tk + k] * arrays.dLdP[i * tk + k];
      rowsum.push(r);
      for (let j = 0; j < tk; j++) dLdS[i * tk + j] = arrays.P[i * tk + j] * (arrays.dLdP[i * tk + j] - r);
    }
    return { queries, keys, tq, tk, P: arrays.P, dLdP: arrays.dLdP, dLdS, rowsum, masked, loss: snap.loss };
  }

  // colour scales: P on 0..1 (viridis stops), the gradients diverging blue-white-red centred on 0
  const VIRIDIS = [[68, 1, 84], [59, 82, 139], [33, 145, 140], [94, 201, 98], [253, 231, 37]];
  function viridis(t) {
    t = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1);
    const i = Math.min(VIRIDIS.length - 2, Math.floor(t)), f = t - i, a = VIRIDIS[i], b = VIRIDIS[i + 1];
    return `rgb(${a.map((v, c) => Math.round(v + f * (b[c] - v))).join(",")})`;
  }
  function diverging(v, limit) {
    const t = Math.max(-1, Math.min(1, v / limit));
    const end = t > 0 ? [178, 24, 43] : [33, 102, 172];
    const s = Math.abs(t);
    return `rgb(${end.map((e) => Math.round(255 + s * (e - 255))).join(",")})`;
  }
  function limitOf(values, masked, tk) {
    let m = 0;
    values.forEach((v, n) => { if (!masked[Math.floor(n / tk)][n % tk] && Number.isFinite(v)) m = Math.max(m, Math.abs(v)); });
    return m || 1;
  }

  function hatch(ctx, x, y, w, h) {
    ctx.fillStyle = MASKED_FILL;
    ctx.fillRect(x, y, w, h);
    ctx.save();
    ctx.beginPath();
    ctx.rect(x, y, w, h);
    ctx.clip();
    ctx.strokeStyle = MASKED_HATCH;
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    for (let d = -h; d < w; d += 6) { ctx.moveTo(x + d, y + h); ctx.lineTo(x + d + h, y); }
    ctx.stroke();
    ctx.restore();
  }

  function drawMap(canvas, values, colour, cur) {
    const { tq, tk, queries, keys, masked } = cur;
    canvas.width = LEFT + tk * CELL + 4;
    canvas.height = TOP + tq * CELL + 4;
    Object.assign(canvas.dataset, { rows: tq, cols: tk, cell: CELL, left: LEFT, top: TOP });
    const ctx = canvas.getContext("2d");
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    ctx.font = "11px sans-serif";
    ctx.fillStyle = "#333";
    ctx.textAlign = "center";
    keys.forEach((k, j) => ctx.fillText(k, LEFT + (j + 0.5) * CELL, TOP - 8));
    ctx.textAlign = "right";
    queries.forEach((q, i) => ctx.fillText(q, LEFT - 6, TOP + (i + 0.5) * CELL + 4));
    for (let i = 0; i < tq; i++) {
      for (let j = 0; j < tk; j++) {
        const x = LEFT + j * CELL, y = TOP + i * CELL;
        if (masked[i][j]) { hatch(ctx, x, y, CELL, CELL); continue; }
        ctx.fillStyle = colour(values[i * tk + j]);
        ctx.fillRect(x, y, CELL, CELL);
      }
    }
    if (state.cell && state.cell[0] < tq && state.cell[1] < tk) {
      ctx.strokeStyle = "#000";
      ctx.lineWidth = 2;
      ctx.strokeRect(LEFT + state.cell[1] * CELL + 1, TOP + state.cell[0] * CELL + 1, CELL - 2, CELL - 2);
    }
  }

  function drawLegend(canvas, colour, lo, hi) {
    const ctx = canvas.getContext("2d"), w = 150;
    ctx.clearRect(0, 0, canvas.width, canvas.height);
    for (let x = 0; x < w; x++) { ctx.fillStyle = colour(lo + (hi - lo) * x / (w - 1)); ctx.fillRect(x, 0, 1, 14); }
    hatch(ctx, w + 14, 0, 14, 14);
    ctx.fillStyle = "#333";
    ctx.font = "11px sans-serif";
    ctx.textAlign = "left";
    ctx.fillText(lo.toPrecision(3), 0, 28);
    ctx.textAlign = "center";
    if (lo < 0) ctx.fillText("0", w / 2, 28);
    ctx.textAlign = "right";
    ctx.fillText(hi.toPrecision(3), w, 28);
    ctx.textAlign = "left";
    ctx.fillText("masked", w + 32, 11);
  }

  function drawMaps() {
    const cur = current();
    const limits = { dLdP: limitOf(cur.dLdP, cur.masked, cur.tk), dLdS: limitOf(cur.dLdS, cur.masked, cur.tk) };
    drawMap($("map-P"), cur.P, viridis, cur);
    drawLegend($("legend-P"), viridis, 0, 1);
    for (const name of ["dLdP", "dLdS"]) {
      const colour = (v) => diverging(v, limits[name]);
      drawMap($("map-" + name), cur[name], colour, cur);
      drawLegend($("legend-" + name), colour, -limits[name], limits[name]);
    }
    $("example-loss").textContent = `loss of this example at step ${DATA.snapshots[state.step].step}: ${fmt(cur.loss)}`;
    showReadout(cur);
  }

  function showReadout(cur) {
    const box = $("readout");
    if (!state.cell || state.cell[0] >= cur.tq || state.cell[1] >= cur.tk) {
      box.dataset.state = "none";
      return;
    }
    const [i, j] = state.cell, n = i * cur.tk + j, isMasked = Boolean(cur.masked[i][j]);
    Object.assign(box.dataset, { state: "cell", step: DATA.snapshots[state.step].step, example: state.example,
      kind: state.kind, layer: state.layer, head: state.head, query: i, key: j, masked: isMasked });
    $("ro-query").textContent = `${i}: ${cur.queries[i]}`;
    $("ro-key").textContent = `${j}: ${cur.keys[j]}`;
    $("ro-masked").textContent = isMasked ? "masked (nothing flows through this cell)" : "";
    $("ro-p").textContent = fmt(cur.P[n]);
    $("ro-dldp").textContent = fmt(cur.dLdP[n]);
    $("ro-rowsum").textContent = fmt(cur.rowsum[i]);
    $("ro-dlds").textContent = fmt(cur.dLdS[n]);
  }

  function onHover(event) {
    const canvas = event.currentTarget, rect = canvas.getBoundingClientRect();
    const x = event.clientX - rect.left, y = event.clientY - rect.top;
    const j = Math.floor((x - LEFT) / CELL), i = Math.floor((y - TOP) / CELL);
    if (i < 0 || j < 0 || i >= Number(canvas.dataset.rows) || j >= Number(canvas.dataset.cols)) return;
    if (state.cell && state.cell[0] === i && state.cell[1] === j) return;
    state.cell = [i, j];
    drawMaps();
  }

  // line charts: x = step, the current step marked by a vertical line
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"];
  function drawChart(canvas, series, logScale) {
    const ctx = canvas.getContext("2d"), W = canvas.width, H = canvas.height;
    const pad = { l: 52, r: 18, t: 8, b: 22 };
    const plotW = W - pad.l - pad.r, legendRows = Math.ceil(series.length / 2), plotH = H - pad.t - pad.b - 13 * legendRows;
    ctx.clearRect(0, 0, W, H);
    const tr = (v) => (logScale ? Math.log10(v) : v);
    let xs = [], ys = [];
    for (const s of series) s.x.forEach((x, n) => { const y = s.y[n]; if (y !== null && (!logScale || y > 0)) { xs.push(x); ys.push(tr(y)); } });
    if (!xs.length) { ctx.fillText("no data", pad.l, pad.t + 20); return; }
    const x0 = Math.min(...xs, 0), x1 = Math.max(...xs, 1);
    let y0 = Math.min(...ys), y1 = Math.max(...ys);
    if (y1 === y0) { y0 -= 0.5; y1 += 0.5; }
    const px = (x) => pad.l + (x - x0) / (x1 - x0) * plotW, py = (y) => pad.t + (1 - (tr(y) - y0) / (y1 - y0)) * plotH;
    ctx.strokeStyle = "#999";
    ctx.strokeRect(pad.l, pad.t, plotW, plotH);
    ctx.fillStyle = "#333";
    ctx.font = "10px sans-serif";
    ctx.textAlign = "right";
    for (const v of [y0, (y0 + y1) / 2, y1]) {
      const label = logScale ? Math.pow(10, v).toPrecision(2) : v.toPrecision(3);
      ctx.fillText(label, pad.l - 3, pad.t + (1 - (v - y0) / (y1 - y0)) * plotH + 3);
    }
    ctx.textAlign = "center";
    ctx.fillText(String(x0), pad.l, pad.t + plotH + 12);
    ctx.fillText(String(x1), pad.l + plotW, pad.t + plotH + 12);
    ctx.fillText("step", pad.l + plotW / 2, pad.t + plotH + 12);
    series.forEach((s, k) => {
      ctx.strokeStyle = ctx.fillStyle = s.colour || PALETTE[k % PALETTE.length];
      ctx.lineWidth = 1.2;
      ctx.beginPath();
      let open = false;
      s.x.forEach((x, n) => {
        const y = s.y[n];
        if (y === null || (logScale && !(y > 0))) { open = false; return; }
        if (s.points) { ctx.fillRect(px(x) - 2, py(y) - 2, 4, 4); return; }
        if (open) ctx.lineTo(px(x), py(y)); else ctx.moveTo(px(x), py(y));
        open = true;
      });
      ctx.stroke();
      const lx = pad.l + (k % 2) * plotW / 2, ly = pad.t + plotH + 26 + 13 * Math.floor(k / 2);
      ctx.fillRect(lx, ly - 7, 10, 3);
      ctx.fillStyle = "#333";
      ctx.textAlign = "left";
      ctx.fillText(s.label, lx + 14, ly - 3);
    });
    const step = DATA.snapshots[state.step].step;
    ctx.strokeStyle = "#d00";
    ctx.lineWidth = 1.5;
    ctx.beginPath();
    ctx.moveTo(px(step), pad.t);
    ctx.lineTo(px(step), pad.t + plotH);
    ctx.stroke();
    canvas.dataset.markedStep = step;
  }

  function drawCharts() {
    const c = DATA.curves;
    const evals = Object.entries(c.eval || {});
    drawChart($("chart-loss"), [{ x: c.step, y: c.loss, label: "training batch" },
      ...evals.filter(([n]) => n === "loss").map(([n, v]) => ({ x: c.eval_step, y: v, label: "held-out", points: true }))], true);
    drawChart($("chart-accuracy"), [{ x: c.step, y: c.accuracy, label: "token accuracy (batch)" },
      ...evals.filter(([n]) => n !== "loss").map(([n, v]) => ({ x: c.eval_step, y: v, label: n + " (held-out)", points: true }))], false);
    drawChart($("chart-grad-norm"), Object.entries(c.grad_norm || {}).map(([n, v]) => ({ x: c.grad_norm_step, y: v, label: n })), true);
  }

  function fillSelect(select, options, value) {
    select.innerHTML = "";
    for (const [v, text] of options) {
      const o = document.createElement("option");
      o.value = v;
      o.textContent = text;
      select.appendChild(o);
    }
    select.value = String(value);
  }

  function fillLayers() {
    const n = kindInfo().layers;
    state.layer = Math.min(state.layer, n - 1);
    fillSelect($("layer"), Array.from({ length: n }, (_, l) => [l, String(l)]), state.layer);
  }

  function showStep() {
    $("step-label").textContent = `${DATA.snapshots[state.step].step} (snapshot ${state.step + 1} of ${DATA.snapshots.length})`;
    drawMaps();
    drawCharts();
  }

  function init() {
    document.title = $("title").textContent = "npformer explorer" + (DATA.title ? ": " + DATA.title : "");
    $("precision").textContent = `Numbers: the recorded ${DATA.dtype} values, shown with ${DIGITS} significant digits ` +
      "(r and dL/dS are computed here from them in float64).";
    const swatch = $("masked-swatch");
    swatch.style.background = `repeating-linear-gradient(45deg, ${MASKED_HATCH} 0 2px, ${MASKED_FILL} 2px 6px)`;
    const slider = $("step");
    slider.max = DATA.snapshots.length - 1;
    slider.value = 0;
    fillSelect($("example"), DATA.examples.map((e, n) => [n, `${n}: ${e.src.join(" ")}`]), 0);
    fillSelect($("kind"), DATA.kinds.map((k) => [k.name, k.title]), state.kind);
    fillSelect($("head"), Array.from({ length: DATA.heads }, (_, h) => [h, String(h)]), 0);
    fillLayers();
    slider.addEventListener("input", () => { state.step = Number(slider.value); showStep(); });
    $("example").addEventListener("change", (e) => { state.example = Number(e.target.value); state.cell = null; drawMaps(); });
    $("kind").addEventListener("change", (e) => { state.kind = e.target.value; state.cell = null; fillLayers(); drawMaps(); });
    $("layer").addEventListener("change", (e) => { state.layer = Number(e.target.value); drawMaps(); });
    $("head").addEventListener("change", (e) => { state.head = Number(e.target.value); drawMaps(); });
    for (const canvas of document.querySelectorAll("canvas.map")) canvas.addEventListener("mousemove", onHover);
    showStep();
    document.body.dataset.ready = "true";
  }

  if (!DATA.snapshots.length) {
    document.getElementById("title").textContent = "npformer explorer: no snapshots in this file";
    document.body.dataset.ready = "true";
  } else {
    init();
  }
})();
