"""npformer.plots: the figures of a run and of attention, on the inputs a run can give them
(empty, non-finite or zero values, many heads), written atomically, and a clear error without
matplotlib."""
import os
import sys

import numpy as np
import pytest

from npformer import plots

pytest.importorskip("matplotlib", reason="the figures need matplotlib (pip install -e .[plot])")

HISTORY = {"step": [1, 2, 3], "loss": [3.0, 2.0, 1.5], "lr": [1e-3] * 3, "grad_norm": [1.0, 0.5, 0.25],
           "layer_grad_norm_step": [1, 3], "layer_grad_norm": {"encoder.layers.0": [0.5, 0.1], "embedding": [1.0, 0.2]}}


def png_size(path):
    """(width, height) in pixels from a PNG's header."""
    with open(path, "rb") as f:
        header = f.read(24)
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


def every_figure(folder):
    """Each plotting function once, writing into `folder`; -> the paths written."""
    weights = np.full((2, 3, 3), 1 / 3)
    return [plots.plot_curves(HISTORY, os.path.join(folder, "curves.png")),
            plots.plot_grad_norms(HISTORY, os.path.join(folder, "grad_norms.png")),
            plots.plot_attention([weights], os.path.join(folder, "attention.png"), "t", "abc", "abc"),
            plots.plot_attention_and_grads(weights, weights - 0.5, os.path.join(folder, "grads.png"), "t", "abc",
                                           "abc")]


def test_figures_go_into_folders_that_do_not_exist_yet(tmp_path):
    for path in every_figure(tmp_path / "runs" / "new"):
        assert png_size(path)[0] > 100


def test_a_figure_that_fails_midway_leaves_the_old_file_and_its_mode(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    path = tmp_path / "curves.png"
    plots.plot_curves(HISTORY, path)
    os.chmod(path, 0o640)
    before = path.read_bytes()

    def half_written(self, fname, **kwargs):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG half")
        raise OSError("disk full")
    monkeypatch.setattr(Figure, "savefig", half_written)
    with pytest.raises(OSError, match="disk full"):
        plots.plot_curves(HISTORY, path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["curves.png"]
    monkeypatch.undo()
    plots.plot_curves(HISTORY, path)
    assert os.stat(path).st_mode & 0o777 == 0o640


def test_a_path_without_extension_is_written_as_png_where_asked(tmp_path):
    assert plots.plot_curves(HISTORY, tmp_path / "curves") == tmp_path / "curves"
    assert os.listdir(tmp_path) == ["curves"] and png_size(tmp_path / "curves")[0] > 100


def test_every_figure_says_how_to_install_matplotlib_without_it(tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    for draw in (lambda: plots.plot_curves(HISTORY, tmp_path / "a.png"),
                 lambda: plots.plot_grad_norms(HISTORY, tmp_path / "b.png"),
                 lambda: plots.plot_attention([np.ones((1, 2, 2))], tmp_path / "c.png", "t", "ab", "ab")):
        with pytest.raises(ImportError, match="npformer.plots needs matplotlib: pip install"):
            draw()


@pytest.fixture
def figures(monkeypatch):
    """The figures the plotting functions make, kept instead of written."""
    made = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: made.append(fig) or path)
    return made


def test_many_heads_and_long_sequences_give_a_figure_of_bounded_size(figures):
    """12 layers x 12 heads of 128 positions asked for a 444-inch square figure (49,000 pixels a
    side, gigabytes to render, minutes of tick labels); the cells shrink instead, and tick labels
    are left out where they could not be read."""
    plots.plot_attention([np.full((12, 128, 128), 1 / 128)] * 12, "a.png", "t", ["q"] * 128, ["k"] * 128)
    plots.plot_attention_and_grads(np.full((64, 32, 32), 1 / 32), np.zeros((64, 32, 32)), "b.png", "t",
                                   ["q"] * 32, ["k"] * 32)
    for fig in figures:
        assert max(fig.get_size_inches()) <= plots._MAX_INCHES
        assert all(not ax.get_xticklabels() for ax in fig.axes[:-1])       # the last: the colour bar
    plots.plot_attention([np.full((2, 5, 5), 0.2)], "c.png", "t", "abcde", "abcde")
    assert [t.get_text() for t in figures[-1].axes[0].get_xticklabels()] == list("abcde")


def test_a_nan_gradient_leaves_every_head_on_one_symmetric_scale(figures):
    grads = np.full((2, 3, 3), 0.1)
    grads[0, 0, 0] = np.nan
    plots.plot_attention_and_grads(np.full((2, 3, 3), 1 / 3), grads, "x.png", "t", "abc", "abc")
    scales = [(im.norm.vmin, im.norm.vmax) for ax in figures[0].axes for im in ax.images
              if ax.get_title().endswith("dL/dP")]
    assert scales == [(-0.1, 0.1)] * 2


@pytest.mark.parametrize("layers, labels, match", [
    ([], ("ab", "ab"), r"layers: expected \(H, Tq, Tk\) arrays of one shape .*got shapes \[\]"),
    ([np.ones((1, 2, 2, 2))], ("ab", "ab"), r"got shapes \[\(1, 2, 2, 2\)\]"),           # a batch, not one example
    ([np.ones((2, 2, 2)), np.ones((3, 2, 2))], ("ab", "ab"), r"got shapes \[\(2, 2, 2\), \(3, 2, 2\)\]"),
    ([np.ones((2, 2, 3))], ("ab", "ab"), "expected 2 and 3 labels .*got 2 and 2"),
])
def test_attention_arrays_or_labels_that_do_not_fit_are_refused_naming_them(layers, labels, match, figures):
    with pytest.raises(ValueError, match="plot_attention: .*" + match):
        plots.plot_attention(layers, "x.png", "t", *labels)
    with pytest.raises(ValueError, match=r"plot_attention_and_grads: weights, grads: .*"
                                         r"got shapes \[\(2, 2, 2\), \(2, 2, 3\)\]"):
        plots.plot_attention_and_grads(np.ones((2, 2, 2)), np.ones((2, 2, 3)), "x.png", "t", "ab", "ab")
    assert not figures


def test_a_zero_norm_or_loss_turns_the_log_scale_linear_rather_than_vanish(figures):
    """A layer whose gradient is 0 (frozen, or cut off from the loss) is what the figure is for; on a
    log axis its line vanished. Non-finite values (a skipped step) do not decide the scale."""
    plots.plot_grad_norms(HISTORY, "a.png")
    frozen = dict(HISTORY, layer_grad_norm={**HISTORY["layer_grad_norm"], "encoder.layers.1": [0.0, 0.0]})
    plots.plot_grad_norms(frozen, "b.png")
    plots.plot_curves(dict(HISTORY, loss=[3.0, float("nan"), float("inf")]), "c.png")
    plots.plot_curves(dict(HISTORY, eval_step=[3], eval_loss=[0.0]), "d.png")
    assert [fig.axes[0].get_yscale() for fig in figures] == ["log", "linear", "log", "linear"]


def test_plot_grad_norms_names_the_history_keys_it_misses(figures):
    with pytest.raises(KeyError, match=r"missing \['layer_grad_norm_step', 'layer_grad_norm'\]"):
        plots.plot_grad_norms({"step": [1], "loss": [1.0], "grad_norm": [1.0]}, "x.png")


def test_empty_single_and_non_finite_histories_draw(tmp_path):
    for i, loss in enumerate([[], [2.0], [2.0, float("nan"), float("inf")] + [1.0] * 30, [1.0, 0.0, -1.0]]):
        history = {"step": list(range(1, len(loss) + 1)), "loss": loss, "lr": [1e-3] * len(loss)}
        assert png_size(plots.plot_curves(history, tmp_path / f"{i}.png"))[0] > 100


def test_plot_attention_draws_masked_cells_grey_not_in_the_colour_of_zero(tmp_path, monkeypatch):
    """The decoder's causal self-attention: P = 0 above the diagonal. Those cells are masked in the
    image, drawn in the colour map's "bad" grey, which no probability has (viridis(0) is dark purple)."""
    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    causal = np.tril(np.ones((4, 4)))
    weights = np.stack([causal / causal.sum(-1, keepdims=True)] * 2)       # (H=2, 4, 4)
    plots.plot_attention([weights], tmp_path / "a.png", "t", "abcd", "abcd")
    future = np.triu(np.ones((4, 4), dtype=bool), 1)
    images = [image for ax in drawn[0].axes for image in ax.images]
    assert len(images) == 2
    for image in images:
        assert (np.ma.getmaskarray(image.get_array()) == future).all()
        bad, zero = image.get_cmap().get_bad(), image.get_cmap()(0.0)
        assert np.abs(np.subtract(bad, zero)).max() > 0.3 and bad[0] == bad[1] == bad[2] and bad[3] == 1
    assert "grey: masked keys (P = 0)" in drawn[0].get_supxlabel()
