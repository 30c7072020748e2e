"""demos/hessian.py at tiny settings: it runs, writes hessian.json and its figures, and every
number it reports is finite (the block heterogeneity was inf where a density underflowed)."""
import importlib.util
import json
import math
import os

import numpy as np
import pytest

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")


def test_hessian_demo_writes_finite_results_and_figures(tmp_path):
    pytest.importorskip("matplotlib", reason="the demo's figures need matplotlib (pip install -e .[plot])")
    spec = importlib.util.spec_from_file_location("demo_hessian", os.path.join(ROOT, "demos", "hessian.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    demo.main(["--steps", "50", "--power-iters", "3", "--lanczos", "5", "--probes", "1", "--out", str(tmp_path)])
    for name in ("hessian.json", "top_eigenvalues.png", "spectra.png", "block_distances.png"):
        assert (tmp_path / name).stat().st_size > 100, name
    summary = json.loads((tmp_path / "hessian.json").read_text())
    assert {"embeddings", "enc0.self.Q", "dec1.cross.O", "enc0.ffn", "output"} <= set(summary["blocks"])
    assert all(math.isfinite(b["top_eigenvalue"]) for b in summary["blocks"].values())
    assert 0 <= summary["block_heterogeneity"] <= 1


def test_forward_over_reverse_and_reverse_over_reverse_give_the_same_products():
    """The two ways of demos/hessian.py to H_bb v agree to rounding on every block of a small model."""
    spec = importlib.util.spec_from_file_location("demo_hessian_products", os.path.join(ROOT, "demos", "hessian.py"))
    hessian = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hessian)
    model, batch = hessian.model_and_batch(hessian.parse_args(["--steps", "0", "--batch", "4"]))
    forward, reverse = (hessian.BlockHessian(model, batch, mode)
                        for mode in ("forward-over-reverse", "reverse-over-reverse"))
    rng = np.random.default_rng(0)
    for block in hessian.blocks_of(model).values():
        v = rng.standard_normal(forward.size(block))
        a, b = forward.hvp(block, v), reverse.hvp(block, v)
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-12 * max(1.0, np.abs(b).max()))
