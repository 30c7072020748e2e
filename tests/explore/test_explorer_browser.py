"""The explorer in a real browser (Debian's chromium, headless, driven by playwright-python): the
page of a short run opens without a request or a console error, the slider and selectors choose
the step, example, kind, layer and head, and the numbers the readout shows for a hovered cell
equal npformer's own P, dL/dP, r = sum_k P dL/dP and dL/dS = P (dL/dP - r) for that step,
recomputed here from the step's checkpoint, to the 7 significant digits shown; masked cells are
drawn hatched (not in the colour of 0). Skipped without playwright or chromium, failed under CI."""
import json
import math
import re
import time

import numpy as np
import pytest

from explorer_run import recorded, short_run  # noqa: F401  (short_run: a fixture)

STEP = 8  # the run keeps checkpoint-step8.npz
# (example, kind, layer, head) whose every cell is hovered
VIEWS = [(0, "encoder_self", 0, 0), (1, "decoder_self", 1, 3), (0, "decoder_self", 0, 1), (1, "cross", 0, 2),
         (0, "cross", 1, 3)]


def labels(ids):
    return [{0: "PAD", 1: "BOS", 2: "EOS"}.get(int(i), str(int(i) - 2)) for i in ids]


def shown_agrees(shown, value, digits=7):
    """`shown` is `value` rounded to `digits` significant digits (half a unit of the last digit)."""
    x = float(shown)
    if value == 0:
        return x == 0
    mantissa = re.sub(r"e.*$", "", shown.lstrip("-"))
    assert len(re.sub(r"\D", "", mantissa).lstrip("0")) == digits, f"{shown!r}: expected {digits} significant digits"
    unit = 10.0 ** (math.floor(math.log10(abs(value))) - digits + 1)
    return abs(x - value) <= 0.5 * unit * (1 + 1e-9)


READOUT = """() => {
  const text = (id) => document.getElementById(id).textContent;
  return {data: {...document.getElementById("readout").dataset}, query: text("ro-query"), key: text("ro-key"),
          p: text("ro-p"), dldp: text("ro-dldp"), rowsum: text("ro-rowsum"), dlds: text("ro-dlds")};
}"""
HATCHED_CELLS = """(id) => {
  const c = document.getElementById(id), d = c.dataset, ctx = c.getContext("2d");
  const [rows, cols, cell, left, top] = [d.rows, d.cols, d.cell, d.left, d.top].map(Number);
  const out = [];
  for (let i = 0; i < rows; i++) {
    const row = [];
    for (let j = 0; j < cols; j++) {
      const px = ctx.getImageData(left + j * cell + 3, top + i * cell + 3, cell - 6, cell - 6).data;
      let grey = true;
      const shades = new Set();
      for (let k = 0; k < px.length; k += 4) {
        if (Math.abs(px[k] - px[k + 1]) > 2 || Math.abs(px[k + 1] - px[k + 2]) > 2) grey = false;
        shades.add(px[k]);
      }
      row.push(grey && shades.size > 1);   // grey with hatching: no colour of either scale
    }
    out.push(row);
  }
  return out;
}"""


@pytest.fixture(scope="module")
def page(short_run, chromium):
    """The short run's explorer.html open in headless chromium; (page, requests, problems)."""
    sync_api, executable = chromium
    url = (short_run / "explorer.html").as_uri()
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            requests, problems = [], []
            page.on("request", lambda r: requests.append(r.url))
            # errors only: the hatching check's pixel reads make chromium warn about readback speed
            page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
            page.route("http*://**/*", lambda route: route.abort())  # none expected; none may leave the machine
            start = time.perf_counter()
            page.goto(url)
            page.wait_for_selector("body[data-ready=true]", timeout=10_000)
            page.opened_in = time.perf_counter() - start
            yield page, url, requests, problems
        finally:
            browser.close()


def choose(page, example, kind, layer, head):
    page.select_option("#example", str(example))
    page.select_option("#kind", kind)
    page.select_option("#layer", str(layer))
    page.select_option("#head", str(head))


def test_hovered_cells_show_npformers_numbers_at_the_slider_step(page, short_run):
    page, url, requests, problems = page
    steps = [s["step"] for s in json.loads((short_run / "explorer.json").read_text())["snapshots"]]
    assert steps == [0, 4, 8, 12]
    page.focus("#step")
    page.keyboard.press("End")
    assert page.inner_text("#step-label").startswith("12 ")
    page.keyboard.press("Home")
    for _ in range(steps.index(STEP)):
        page.keyboard.press("ArrowRight")
    assert page.inner_text("#step-label").startswith(f"{STEP} ")
    assert page.get_attribute("#chart-loss", "data-marked-step") == str(STEP)
    checkpoint = short_run / f"checkpoint-step{STEP}.npz"
    expected = {example: recorded(checkpoint, page_example_index)
                for example, page_example_index in enumerate(json.loads((short_run / "explorer.json").read_text())
                                                              ["examples"][i]["index"] for i in range(2))}
    checked = masked_seen = 0
    for example, kind, layer, head in VIEWS:
        choose(page, example, kind, layer, head)
        arrays, batch, loss = expected[example]
        assert shown_agrees(page.inner_text("#example-loss").rsplit(" ", 1)[1], loss)
        weights, grads = (a[head].astype(np.float64) for a in arrays[kind][layer])   # (Tq, Tk) from float32
        rowsum = (weights * grads).sum(-1)
        score_grads = weights * (grads - rowsum[:, None])
        query, key = {"encoder_self": (batch.src, batch.src), "decoder_self": (batch.tgt_in, batch.tgt_in),
                      "cross": (batch.tgt_in, batch.src)}[kind]
        query, key = labels(query[0]), labels(key[0])
        causal = np.triu(np.ones(weights.shape, dtype=bool), 1) if kind == "decoder_self" else \
            np.zeros(weights.shape, dtype=bool)
        canvas = page.locator("#map-dLdS" if (example + layer) % 2 else "#map-P")
        cell, left, top = (int(canvas.get_attribute(f"data-{a}")) for a in ("cell", "left", "top"))
        assert (int(canvas.get_attribute("data-rows")), int(canvas.get_attribute("data-cols"))) == weights.shape
        canvas.scroll_into_view_if_needed()
        origin = canvas.bounding_box()   # the mouse moves in page coordinates
        for i in range(weights.shape[0]):
            for j in range(weights.shape[1]):
                page.mouse.move(origin["x"] + left + (j + 0.5) * cell, origin["y"] + top + (i + 0.5) * cell)
                shown = page.evaluate(READOUT)
                where = f"step {STEP}, example {example}, {kind} layer {layer} head {head}, cell ({i}, {j})"
                assert shown["data"] == {"state": "cell", "step": str(STEP), "example": str(example), "kind": kind,
                                         "layer": str(layer), "head": str(head), "query": str(i), "key": str(j),
                                         "masked": str(bool(causal[i, j])).lower()}, where
                assert (shown["query"], shown["key"]) == (f"{i}: {query[i]}", f"{j}: {key[j]}"), where
                for name, value in (("p", weights[i, j]), ("dldp", grads[i, j]), ("rowsum", rowsum[i]),
                                    ("dlds", score_grads[i, j])):
                    assert shown_agrees(shown[name], value), \
                        f"{where}: {name} shows {shown[name]}, npformer's is {value!r}"
                checked += 1
                masked_seen += bool(causal[i, j])
                if causal[i, j]:
                    assert weights[i, j] == 0 and shown["p"] == "0"
    assert checked > 100 and masked_seen > 10
    assert problems == [] and requests == [url]


def test_masked_cells_are_hatched_grey_in_every_panel_and_no_other_cell_is(page):
    page, url, requests, problems = page
    for example, kind in ((0, "decoder_self"), (1, "decoder_self"), (0, "encoder_self"), (1, "cross")):
        choose(page, example, kind, 1, 2)
        rows = int(page.get_attribute("#map-P", "data-rows"))
        cols = int(page.get_attribute("#map-P", "data-cols"))
        expected = (np.triu(np.ones((rows, cols), dtype=bool), 1) if kind == "decoder_self"
                    else np.zeros((rows, cols), dtype=bool)).tolist()
        for panel in ("map-P", "map-dLdP", "map-dLdS"):
            assert page.evaluate(HATCHED_CELLS, panel) == expected, f"{panel}, {kind}, example {example}"
    assert "masked" in page.inner_text("body") and page.locator("#masked-swatch").count() == 1
    assert problems == [] and requests == [url]


def test_the_page_opens_within_seconds_and_draws_the_three_curves(page):
    page, url, requests, problems = page
    assert page.opened_in < 5
    for chart in ("#chart-loss", "#chart-accuracy", "#chart-grad-norm"):
        assert page.get_attribute(chart, "data-marked-step") is not None
