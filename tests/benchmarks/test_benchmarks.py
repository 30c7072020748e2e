"""The benchmarks against torch / Hugging Face measure the same work on both sides: the same
model (parameters, loss and gradients on equal weights), dropout at the same sites, the same
FLOPs as an independent count, the same threads, and counts (tokens, memory) that mean what
they say. The scripts that set threads at import run in a subprocess."""
import collections
import importlib.util
import json
import os
import re
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from autograd import Tensor
from tests.tolerances import assert_close, host, scaled

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


@pytest.fixture(scope="module")
def train_step():
    spec = importlib.util.spec_from_file_location("train_step", BENCHMARKS / "train_step.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def runners(train_step, name, dropout):
    cfg = dict(train_step.CONFIGS[name], dropout=dropout)
    return cfg, train_step.Ours(cfg, "cpu"), train_step.Torch(cfg, "cpu")


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("name", ["tiny", "gpt_char"])
def test_train_step_twins_give_the_same_loss_and_gradients_on_equal_weights(torch, train_step, name):
    """Ours and the torch side of train_step.py: the same parameters (names, shapes), and on ours'
    weights without dropout the same loss and gradients (float64: only rounding may differ)."""
    cfg, ours, twin = runners(train_step, name, dropout=0.0)
    ours.model.to(dtype="float64")
    state = {k: torch.from_numpy(np.array(v)) for k, v in ours.model.state_dict().items()}
    assert {k: v.shape for k, v in twin.model.state_dict().items()} == {k: v.shape for k, v in state.items()}
    twin.model.double().load_state_dict(state)
    if not cfg.get("causal"):  # the sinusoidal table, a non-persistent buffer (float32-rounded on torch's side)
        twin.model.pe = torch.from_numpy(host(dict(ours.model.named_buffers())["positional.pe"]))
    src, tgt_in, tgt_out = ours.batch
    logits = ours.model(tgt_in) if cfg.get("causal") else ours.model(src, tgt_in)
    loss = ours.F.cross_entropy(logits.reshape(-1, cfg["vocab"]), tgt_out.reshape(-1))
    loss.backward()
    src, tgt_in, tgt_out = twin.batch
    logits = twin.model(tgt_in) if cfg.get("causal") else twin.model(src, tgt_in)
    torch_loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab"]), tgt_out.reshape(-1))
    torch_loss.backward()
    assert loss.item() == pytest.approx(torch_loss.item(), rel=1e-12)
    torch_parameters = dict(twin.model.named_parameters())
    assert len(torch_parameters) == len(list(ours.model.parameters()))
    for key, p in ours.model.named_parameters():
        grad = p.grad.data if isinstance(p.grad, Tensor) else p.grad
        expected = torch_parameters[key].grad
        assert_close(grad, expected, atol=scaled(1e-10, expected), err_msg=key)


def count_dropout(torch, train_step, name):
    """{(site, p, shape...): calls} of one training step of each side, dropout 0.1."""
    import npformer.functional as F
    cfg, ours, twin = runners(train_step, name, dropout=0.1)
    counts = {"ours": collections.Counter(), "torch": collections.Counter()}

    def dropout_key(x, p=0.5, training=True, *rest, **kwargs):
        return ("dropout", p, tuple(x.shape)) if training and p else None

    def residual_key(x, residual, p=0.5, training=True, **kwargs):
        return dropout_key(x, p, training)

    def attention_key(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kwargs):
        return ("attention", dropout_p, tuple(q.shape[:-1]) + (k.shape[-2],), is_causal)

    patches = [(F, "dropout", dropout_key, "ours"), (F, "dropout_add", residual_key, "ours"),
               (F, "scaled_dot_product_attention", attention_key, "ours"),
               (torch.nn.functional, "dropout", dropout_key, "torch"),
               (torch.nn.functional, "scaled_dot_product_attention", attention_key, "torch")]
    saved = [(module, attr, getattr(module, attr)) for module, attr, _, _ in patches]

    def counting(fn, key, side):
        def wrapper(*args, **kwargs):
            site = key(*args, **kwargs)
            if site is not None:
                counts[side][site] += 1
            return fn(*args, **kwargs)
        return wrapper
    try:
        for module, attr, key, side in patches:
            setattr(module, attr, counting(getattr(module, attr), key, side))
        ours.step()
        twin.step()
    finally:
        for module, attr, fn in saved:
            setattr(module, attr, fn)
    return counts


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("name", ["tiny", "gpt_char"])
def test_train_step_twins_drop_out_at_the_same_sites(torch, train_step, name):
    """Every dropout site (embeddings, residuals, activations, attention probabilities) on both
    sides with the same p and the same size, the same number of times."""
    counts = count_dropout(torch, train_step, name)
    assert counts["ours"] == counts["torch"]
    assert sum(counts["ours"].values()) > 4


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("name", ["tiny", "gpt_char"])
def test_train_step_flop_formula_equals_torchs_flop_counter(torch, train_step, name):
    """training_flops: the matrix products of forward and backward, counted by torch's
    FlopCounterMode on the torch side (its math attention: every product visible)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    cfg, _, twin = runners(train_step, name, dropout=0.0)
    src, tgt_in, tgt_out = twin.batch
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        logits = twin.model(tgt_in) if cfg.get("causal") else twin.model(src, tgt_in)
        torch.nn.functional.cross_entropy(logits.reshape(-1, cfg["vocab"]), tgt_out.reshape(-1)).backward()
    assert train_step.training_flops(cfg) == counter.get_total_flops()


@pytest.mark.parametrize("name", ["tiny", "gpt_char"])
def test_train_step_flop_formula_equals_the_products_ours_step_runs(train_step, name):
    """training_flops: every matrix product (2 m k n, batched ones times their batch) of one step
    of ours with the benchmark's dropout, seen on the "test" device (step_products), whose arrays
    see every product and which runs the references (the CPU's split of them runs the same
    products); the bias gradients' matrix-vector products 1^T dy are no GEMM and left out."""
    cfg = dict(train_step.CONFIGS[name], dropout=0.1)
    products, gemv = train_step.step_products(cfg)
    assert sum(map(train_step.product_flops, products)) == train_step.training_flops(cfg)
    assert 0 < gemv < 0.01 * train_step.training_flops(cfg)


def test_train_step_times_each_product_laid_out_as_the_steps(train_step):
    """shape_floor's operands have the shapes and strides (bytes) of the step's: a transposed
    weight, a head of the packed q/k/v projection (gaps between its rows), a broadcast axis; its
    time is positive and its FLOPs those of the products it timed."""
    rng = np.random.default_rng(0)
    packed = np.empty((2, 6, 3 * 8), dtype=np.float32)                    # (B, T, 3 E)
    heads = packed[:, :, :8].reshape(2, 6, 2, 4).transpose(0, 2, 1, 3)   # (B, H, T, hd), a view with gaps
    for array in (np.empty((5, 3), np.float32).T, heads, np.broadcast_to(np.empty((1, 4, 6), np.float32), (3, 4, 6))):
        made = train_step.laid_out(array.shape, array.strides, rng)
        assert (made.shape, made.strides, made.dtype) == (array.shape, array.strides, np.float32)
        assert np.isfinite(made).all()
    cfg = dict(train_step.CONFIGS["tiny"], dropout=0.1)
    products = train_step.step_products(cfg)[0]
    seconds, flops = train_step.shape_floor(products, 1)
    assert seconds > 0 and flops == train_step.training_flops(cfg)


def test_train_step_tokens_count_the_sequences_a_step_reads(train_step):
    """tokens/s: source + target for the encoder-decoder, the one sequence of a causal LM."""
    tiny, gpt = train_step.CONFIGS["tiny"], train_step.CONFIGS["gpt_char"]
    assert train_step.tokens_per_step(tiny) == 2 * tiny["batch"] * tiny["seq"]
    assert train_step.tokens_per_step(gpt) == gpt["batch"] * gpt["seq"]


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_train_step_memory_runs_every_side_and_reports_memory_above_the_imports(torch):
    """On the test device (ours eager and graphed beside torch) the memory runs measure all three
    sides (the graphed side used to stop the script), each in all and above its imports (the
    peers, not measured there, are left out)."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "train_step.py"), "--config", "tiny", "--device", "test",
                             "--steps", "1", "--threads", "1", "--dropout", "0", "--no-compile", "--no-jax"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("peak host memory"))
    assert line.count("graphed") == 2 and "above the imported libraries" in line, line


@pytest.fixture(scope="module")
def jax():
    """jax (optional: `pip install jax`, not in the dev extra) on its CPU backend."""
    module = pytest.importorskip("jax", reason="jax is not installed: `pip install -e .[jax]` (optional peer)")
    module.config.update("jax_platforms", "cpu")
    return module


@pytest.mark.parametrize("name", ["tiny", "gpt_char"])
def test_train_step_jax_twin_trains_as_ours_without_dropout(train_step, jax, name):
    """The jax twin from ours' initial weights: without dropout the loss of each of the first steps
    (so the model, the gradients and the Adam/AdamW updates between them) is ours' up to float32
    rounding."""
    cfg = dict(train_step.CONFIGS[name], dropout=0.0)
    ours = train_step.Ours(cfg, "cpu")
    twin = train_step.Jax(cfg, ours, jax)
    for step in range(3):
        expected = ours.step()
        assert twin.step() == pytest.approx(expected, abs=train_step.jax_loss_tolerance(expected, cfg)), step


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
@pytest.mark.parametrize("name", ["tiny", "gpt_char"])
def test_train_step_jax_twin_drops_out_at_ours_sites(monkeypatch, torch, train_step, jax, name):
    """Every dropout of the jax twin's training loss (a Bernoulli mask) has a site of ours' step
    with the same p and shape, as many times (ours' sites: count_dropout)."""
    ours_sites = collections.Counter()
    for (_, p, shape, *_), calls in count_dropout(torch, train_step, name)["ours"].items():  # (site, p, shape...)
        ours_sites[(p, tuple(shape))] += calls
    twin_sites = collections.Counter()
    bernoulli = jax.random.bernoulli

    def recording(key, p, shape):
        twin_sites[(round(1.0 - p, 12), tuple(shape))] += 1
        return bernoulli(key, p, shape)

    cfg = dict(train_step.CONFIGS[name], dropout=0.1)
    twin = train_step.Jax(cfg, train_step.Ours(cfg, "cpu"), jax)
    monkeypatch.setattr(jax.random, "bernoulli", recording)
    jax.eval_shape(lambda params, key: twin.loss(params, twin.batch, key, True), twin.state[0], twin.state[4])
    assert twin_sites == ours_sites


@pytest.fixture(scope="module")
def peers_run(torch):
    """train_step.py's output at the tiny config, a few steps on one thread, with its peers:
    torch.compile in the default mode, jax when it is importable."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "train_step.py"), "--config", "tiny", "--steps", "3",
                             "--threads", "1", "--no-memory", "--compile-mode", "default"],
                            capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-4000:] + result.stdout
    return result.stdout


def timed_row(stdout, name):
    """(ms/step, multiple of the GEMM floor) of the runner `name`'s row, None when it has none."""
    match = re.search(rf"^ *{re.escape(name)}: +([\d.]+) ms/step .* ([\d.]+)x the GEMM floor$", stdout, re.M)
    return (float(match[1]), float(match[2])) if match else None


def peer_line(stdout, name, start):
    """The line of `name` whose text after "name: " starts with `start`, or None."""
    match = re.search(rf"^ *{re.escape(name)}: ({re.escape(start)}.*)$", stdout, re.M)
    return match[1] if match else None


@pytest.mark.slow
def test_train_step_prints_the_gemm_floor_and_each_time_as_a_multiple_of_it(train_step, peers_run):
    """The floor is training_flops at the measured GEMM rate (measured on --threads BLAS threads,
    its core type and OPENBLAS_CORETYPE said), every timed row is its time over the floor, and the
    closing row is ours over the fastest peer; within the rounding of the printed figures."""
    out = peers_run
    floor = re.search(r"^GEMM floor: ([\d.]+) ms/step = (\d+) GEMM FLOPs per step \(training_flops\) / "
                      r"([\d.]+) GFLOP/s$", out, re.M)
    assert floor, out
    floor_ms, flops, rate = float(floor[1]), int(floor[2]), float(floor[3])
    assert flops == train_step.training_flops(dict(train_step.CONFIGS["tiny"], dropout=0.1))
    # the floor printed to 0.001 ms, the rate to 0.1 GFLOP/s
    assert abs(floor_ms - flops / rate / 1e6) <= 5e-4 + flops / rate / 1e6 * 0.05 / rate
    assert re.search(rf"^measured GEMM rate: {rate} GFLOP/s \(float32 1024 x 1024 @ 1024 x 1024, best of 5 after 2 "
                     r"untimed, numpy's BLAS: .*, core type \S+, threads 1; OPENBLAS_CORETYPE (not set|set to \S+)\)$",
                     out, re.M), out
    shapes = re.search(r"^GEMMs at the step's shapes: ([\d.]+) ms/step = ([\d.]+)x the GEMM floor: its (\d+) products "
                       rf"\({flops} FLOPs\) at ([\d.]+) GFLOP/s, each alone, laid out as ours', best of 3 after 1 untimed, "
                       r"BLAS threads 1 \(the rate's\)$", out, re.M)
    assert shapes, out
    # ms and the floor printed to 0.001, the multiple to 0.01, the rate to 0.1 GFLOP/s: each bound is the
    # printed figure's own rounding plus what the rounding of the figures it is computed from can move it by
    shapes_ms = float(shapes[1])
    multiple = shapes_ms / floor_ms
    assert float(shapes[2]) == pytest.approx(multiple, abs=0.005 + 5e-4 / floor_ms + 5e-4 * multiple / floor_ms + 1e-9)
    shapes_rate = flops / shapes_ms / 1e6
    assert float(shapes[4]) == pytest.approx(shapes_rate, abs=0.05 + 5e-4 * shapes_rate / shapes_ms + 1e-9)
    rows = {name: timed_row(out, name) for name in ("ours", "torch", "torch.compile[default]", "jax.jit")}
    assert rows["ours"] and rows["torch"], out
    for name, (ms, multiple) in ((name, r) for name, r in rows.items() if r):
        # ms and the multiple printed to 0.1, the floor to 0.001 ms
        rounding = 0.05 + 0.05 / floor_ms + 5e-4 / floor_ms * ms / floor_ms
        assert multiple == pytest.approx(ms / floor_ms, abs=rounding), name
    peers = {name: r[0] for name, r in rows.items() if r and name != "ours"}
    # peers that tie at 0.1 ms could be either side of each other before rounding
    best = "|".join(re.escape(name) for name, ms in peers.items() if ms == min(peers.values()))
    summary = re.search(rf"^npformer / best peer: ours / (?:{best}) ([\d.]+)x \(([\d.]+) vs ([\d.]+) ms/step\)$",
                        out, re.M)
    assert summary, out
    assert (float(summary[2]), float(summary[3])) == (rows["ours"][0], min(peers.values()))
    # the ratio printed to 0.01, each time to 0.1 ms: r = a / b moves by 0.05 / b + 0.05 * a / b**2 at most
    ours, peer = rows["ours"][0], min(peers.values())
    assert float(summary[1]) == pytest.approx(ours / peer, abs=0.005 + 0.05 / peer + 0.05 * ours / peer ** 2 + 1e-9)
    cpu = next(line for line in out.splitlines() if line.startswith("CPU time / wall time in the timed steps"))
    assert all(f" {name} " in cpu for name, r in rows.items() if r), cpu
    recorded = timed_row(out, "recorded")                   # the recorded step (npformer.recorded) on the CPU
    assert recorded and " recorded " in cpu, out
    ratio = re.search(r"^ratio recorded/torch: ([\d.]+)x  \(recorded/eager ([\d.]+)x\)$", out, re.M)
    assert ratio and float(ratio[2]) == pytest.approx(recorded[0] / rows["ours"][0],
                                                      abs=0.005 + 0.05 / rows["ours"][0] + 0.05 * recorded[0] /
                                                      rows["ours"][0] ** 2 + 1e-9), out
    assert re.search(rf"^npformer / best peer: recorded / (?:{best}) [\d.]+x \({recorded[0]} vs [\d.]+ ms/step\)$",
                     out, re.M), out


@pytest.mark.slow
def test_train_step_times_torch_compile_of_the_whole_step(peers_run):
    """torch.compile's row beside the others, its compilation in untimed warm-up steps whose
    Dynamo graphs are counted; or the reason compilation cannot run here."""
    skipped = peer_line(peers_run, "torch.compile[default]", "skipped: compilation failed on this machine: ")
    if skipped:
        pytest.skip(f"torch.compile cannot run here: {skipped}")
    assert timed_row(peers_run, "torch.compile[default]"), peers_run
    warmup = peer_line(peers_run, "torch.compile[default]", "3 untimed warm-up steps in ")
    assert warmup and int(re.search(r"; (\d+) graphs, \d+ graph breaks$", warmup)[1]) >= 1, peers_run


@pytest.mark.slow
def test_train_step_times_the_jax_twin_after_checking_its_loss(peers_run):
    """With jax: its threads as set (one: the XLA flag, and the client made on one CPU where there
    are more), the loss check passed, its row; without jax: the message saying it is skipped."""
    if importlib.util.find_spec("jax") is None:
        assert peer_line(peers_run, "jax.jit", "skipped: jax is not importable"), peers_run
        pytest.skip("jax is not installed (`pip install -e .[jax]`): its skip message checked")
    threads = next(line for line in peers_run.splitlines() if line.startswith("threads: "))
    assert "jax: XLA_FLAGS=--xla_cpu_multi_thread_eigen=false set before the import" in threads, threads
    if len(os.sched_getaffinity(0)) > 1:
        assert "CPU client made under an affinity of 1 of the" in threads, threads
    check = peer_line(peers_run, "jax.jit check", "the loss without dropout at ours' initial weights: ")
    assert check and check.endswith("(float32 rounding): equal"), peers_run
    assert timed_row(peers_run, "jax.jit"), peers_run


def run_python(code, threads_env=None):
    """`code` in a fresh interpreter at the root with benchmarks/ on the path, BLAS and npformer
    thread variables removed from the environment (then `threads_env` added); its last line as JSON."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "NPFORMER_NUM_THREADS")}
    env.update(threads_env or {}, PYTHONPATH=os.pathsep.join([str(ROOT), str(BENCHMARKS)]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env=env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_generate_threads_gives_numpys_blas_that_many_threads():
    """generate.py --threads N: numpy's BLAS (which threads ours' decoding products) gets N threads
    as torch does, not BLAS's default of every core (it was set for N = 1 only)."""
    out = run_python("import sys, os, json; sys.argv = ['generate.py', '--threads', '3']; import generate; "
                     "print(json.dumps({v: os.environ.get(v) for v in ('OPENBLAS_NUM_THREADS', 'OMP_NUM_THREADS')}))")
    assert out == {"OPENBLAS_NUM_THREADS": "3", "OMP_NUM_THREADS": "3"}


def test_generate_header_reports_the_threads_of_ours_decoding_steps():
    """The threads inside `generate`'s decoding steps: npformer's ops on one thread, BLAS's threads."""
    out = run_python("import sys, json; sys.argv = ['generate.py', '--threads', '1']; import generate\n"
                     "import numpy as np\n"
                     "from npformer import models\n"
                     "model = models.CausalLM(50, d_model=16, nhead=2, num_layers=1, dim_feedforward=32, max_len=8)\n"
                     "print(json.dumps(generate.generation_threads(model, np.zeros((1, 2), dtype=np.int64))))",
                     {"NPFORMER_NUM_THREADS": "2"})
    assert out == [1, "1"]


def test_decode_runs_ours_on_blas_threads_only():
    """decode.py: ours on --threads BLAS threads and npformer's one, as torch on --threads threads
    (npformer's default, one thread per core, gave ours more cores than torch)."""
    out = run_python("import sys, json, decode, npformer\n"
                     "seen = []\n"
                     "greedy = decode.greedy_decode\n"
                     "def probe(*args, **kwargs):\n"
                     "    seen.append(npformer.runtime.threads.get_num_threads())\n"
                     "    return greedy(*args, **kwargs)\n"
                     "decode.greedy_decode = probe\n"
                     "decode.main(['--config', 'tiny', '--batch', '2', '--src-len', '4', '--tgt-len', '2', "
                     "'--repeat', '1', '--no-torch'])\n"
                     "print(json.dumps(sorted(set(seen))))", {"NPFORMER_NUM_THREADS": "2"})
    assert out == [1]


def test_attention_runs_ours_on_blas_threads():
    """attention.py's CPU worker: B = 1 gives npformer's threads nothing to split, so ours runs on
    one npformer thread and BLAS's threads, as many as torch's (npformer's default held BLAS to
    one thread while torch used every core)."""
    out = run_python("import json, attention, npformer\n"
                     "import npformer.functional as F\n"
                     "seen = []\n"
                     "sdpa = F.scaled_dot_product_attention\n"
                     "def probe(*args, **kwargs):\n"
                     "    seen.append(npformer.runtime.threads.get_num_threads())\n"
                     "    return sdpa(*args, **kwargs)\n"
                     "F.scaled_dot_product_attention = probe\n"
                     "attention.cpu_worker('ours-naive', 16, 1, False, 512)\n"
                     "print(json.dumps(sorted(set(seen))))", {"NPFORMER_NUM_THREADS": "2"})
    assert out == [1]


def test_hvp_attention_memory_runs_both_paths_and_the_memory_efficient_one_holds_no_score_matrix():
    """hvp.py --attention-memory at tiny settings: both paths run in their own process and report
    the memory their HVP adds; the memory-efficient one stays well below the naive one's
    (T = 512: one (T, T) float64 matrix is 2 MB, the naive path holds several)."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "hvp.py"), "--attention-memory", "--seq", "512",
                             "--head-dim", "4", "--block-size", "64"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    assert "memory-efficient / naive" in result.stdout, result.stdout
    memory = json.loads(result.stdout.strip().splitlines()[-1])
    assert memory["naive"]["traced_mb"] > 3 * 2.0
    assert memory["memory_efficient"]["traced_mb"] < memory["naive"]["traced_mb"] / 4


def test_attention_modern_measures_the_window_and_the_grouped_query_step(torch):
    """attention_modern.py at tiny sizes: the window path's time and peak at each length, the
    naive path's peak in (T, T) matrices (it holds at least P), the window path's peak far below
    one (T, T) matrix once T is many windows long, and the grouped-query step against torch (the
    script first checks that both give the same gradients)."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "attention_modern.py"), "--lengths", "256", "1024",
                             "--window", "16", "--head-dim", "8", "--block-size", "16", "--full-length", "256",
                             "--gqa", "1", "4", "2", "16", "8", "--repeats", "1", "--threads", "1", "--json"],
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(report["lengths"]) == {"256", "1024"} and report["length_ratio"] == 4
    assert report["full_path"]["matrices"] >= 1                    # the naive path keeps P, one (T, T) matrix
    assert report["full_path"]["window_peak_mb"] < report["full_path"]["peak_mb"]
    assert report["memory_ratio"] < 0.1                            # T = 1024 is 64 windows of 16
    assert report["gqa"]["ours"] > 0 and report["gqa"]["torch"] > 0 and report["gqa"]["ratio"] > 0


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_hvp_model_runs_every_runner_and_ours_agree_with_torch(torch):
    """hvp.py's default mode on tiny_gpt: both of ours' HVPs agree with torch's reverse over reverse
    (the script exits otherwise), every runner is timed and the ratios are printed."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "hvp.py"), "--config", "tiny_gpt", "--steps", "1",
                             "--threads", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr + result.stdout
    for line in ("ours forward over reverse:", "ours reverse over reverse:", "torch reverse over reverse:",
                 "ours forward over reverse / reverse over reverse:",
                 "ratio ours forward over reverse / torch reverse over reverse:"):
        assert line in result.stdout, result.stdout
    assert result.stdout.count("/ max |torch's|") >= 2, result.stdout


def functions_without_jvp():
    """The Functions of npformer.functional that have no forward-mode rule yet."""
    import npformer.functional  # noqa: F401  (defines them)
    from autograd import Function

    found, stack = [], list(Function.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if cls.__module__.startswith("npformer.functional") and getattr(cls, "jvp", None) is None:
            found.append(cls.__qualname__)
    return sorted(found)


@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_jvp_runs_both_parts_and_ours_matches_torch(torch):
    """benchmarks/jvp.py with tiny settings: (1) ours' J u of the logits is torch.func.jvp's up to
    float32 rounding, and both are timed; (2) both attention paths' memory is measured and compared."""
    missing = functions_without_jvp()
    result = subprocess.run([sys.executable, str(BENCHMARKS / "jvp.py"), "--batch", "2", "--seq", "8", "--steps", "1",
                             "--attention-length", "64", "--block-size", "16"] + (["--no-model"] if missing else []),
                            capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    memory = next(line for line in result.stdout.splitlines() if line.startswith("(2) attention JVP at T = 64"))
    assert "naive" in memory and "memory_efficient" in memory and memory.count("ratio") == 2, memory
    if missing:
        pytest.skip(f"(1) needs a jvp rule in {', '.join(missing)} (issue #26's other branches)")
    assert "ratio ours/torch" in result.stdout
    tangent = float(result.stdout.split("tangent ")[1].split()[0])
    assert tangent < 1e-4, result.stdout


def test_demo_step_sweeps_batch_sizes_that_replay_their_recording():
    """demo_step.py's fixed cost is the replayed step's: its trainers keep one shape (every sequence
    of the longest length), so after the eager and recorded calls every step replays."""
    out = run_python("import json, demo_step\n"
                     "t = demo_step.trainer(3, demo_step.one_shape())\n"
                     "demo_step.run(t, 6)\n"
                     "print(json.dumps([t._recorded.calls, t._recorded.eager_calls, t._recorded.replays]))")
    assert out == [6, 2, 4]


def test_demo_step_prints_each_batch_size_and_each_threads_run():
    result = subprocess.run([sys.executable, str(BENCHMARKS / "demo_step.py"), "--steps", "1", "--batches", "1,3",
                             "--threads", "1"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == "npformer's threads: 1"
    assert [line.split(":")[0].split() for line in lines[2:4]] == [["batch", "1"], ["batch", "3"]]
    runs = [line for line in lines if "threads / one after the other" in line]
    assert len(runs) == 3
    for line in runs:
        times = [float(x) for x in line.split("(")[0].split("|")]
        assert len(times) == 3 and min(times) > 0


@pytest.mark.parametrize("args, message", [(["--steps", "0"], "--steps: expected a positive integer, got 0"),
                                           (["--batches", "1,x"], "--batches: expected batch sizes separated by"),
                                           (["--batches", "0"], "--batches: expected positive batch sizes, got '0'"),
                                           (["--threads", "0"], "--threads: expected a positive integer, got 0")])
def test_demo_step_refuses_bad_arguments_in_one_line(args, message):
    result = subprocess.run([sys.executable, str(BENCHMARKS / "demo_step.py"), *args], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 2 and message in result.stderr.splitlines()[-1]


def test_machinery_measures_each_piece_on_and_off_and_tabulates_the_ratios():
    """machinery.py on tiny, one alternation of two pieces: one switched in the process (lookahead)
    and one in two worker processes (host-memory): a row each (on, off, off/on, alternations) and
    the markdown table with the verdict that the ratio gives."""
    result = subprocess.run([sys.executable, str(BENCHMARKS / "machinery.py"), "--configs", "tiny", "--steps", "1",
                             "--pieces", "lookahead,host-memory"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    rows = [line.split() for line in lines if line.endswith("(1 alternation)")]
    assert [row[:2] for row in rows] == [["tiny", "lookahead"], ["tiny", "host-memory"]], result.stdout
    ratios = {}
    for row in rows:
        on, off, ratio = float(row[3]), float(row[6]), float(row[9])
        assert row[2:10:3] == ["on", "off", "off/on"] and on > 0 and off > 0
        assert ratio == pytest.approx(off / on, abs=2e-3)
        ratios[row[1]] = ratio
    table = [line for line in lines if line.startswith("|")]
    assert table[:2] == ["| piece | tiny | verdict |", "|---|---:|---|"]
    assert len(table) == 4
    for line in table[2:]:
        name, ratio, verdict = (cell.strip() for cell in line.strip("|").split("|"))
        assert float(ratio) == pytest.approx(ratios[name], abs=6e-3)
        if abs(ratios[name] - 1.03) > 1e-3:
            assert verdict == ("KEEP" if ratios[name] >= 1.03 else "candidate to delete")


@pytest.mark.parametrize("args, message", [(["--steps", "0"], "--steps: expected a positive integer, got 0"),
                                           (["--configs", "tiny,paper"], "--configs: expected some of"),
                                           (["--pieces", "lookahead,nope"], "--pieces: unknown nope")])
def test_machinery_refuses_bad_arguments_in_one_line(args, message):
    result = subprocess.run([sys.executable, str(BENCHMARKS / "machinery.py"), *args], capture_output=True, text=True,
                            timeout=60, cwd=ROOT)
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1 and message in result.stderr, result.stderr
