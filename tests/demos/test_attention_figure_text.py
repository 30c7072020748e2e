"""The P / dL/dP / dL/dS figure (plots.plot_attention_and_grads, drawn by demos/attention_grads.py
and notebooks 01 and 03) says what dL/dS is, the row sum of what included, and none of its
labels is clipped by the figure's edge or runs into another, in the smallest figure (one head,
three tokens) as in a large one (issue 44 item 6)."""
import numpy as np
import pytest

from npformer import plots

matplotlib = pytest.importorskip("matplotlib", reason="the figures need matplotlib (pip install -e .[plot])")


@pytest.mark.parametrize("heads, tokens", [(1, 3), (4, 8)])
def test_labels_fit_and_say_what_the_row_sum_is(tmp_path, monkeypatch, heads, tokens):
    figures = []
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, path: (figures.append(fig), save(fig, path))[1])
    rng = np.random.default_rng(0)
    weights = rng.dirichlet(np.ones(tokens), size=(heads, tokens))
    plots.plot_attention_and_grads(weights, rng.standard_normal(weights.shape), tmp_path / "f.png", "title",
                                   [str(i) for i in range(tokens)], [str(i) for i in range(tokens)])
    (fig,) = figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    canvas = FigureCanvasAgg(fig)
    canvas.draw()                                # the layout the PNG has
    renderer = canvas.get_renderer()
    texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text().strip()]
    words = " ".join(" ".join(t.get_text().split()) for t in texts)   # a wrapped caption reads as one line
    assert "r = sum over the keys of P dL/dP" in words and "rowsum" not in words
    page = fig.bbox
    boxes = []
    for t in texts:
        box = t.get_window_extent(renderer)
        assert page.x0 - 1 <= box.x0 and box.x1 <= page.x1 + 1 and page.y0 - 1 <= box.y0 and box.y1 <= page.y1 + 1, \
            f"{t.get_text()!r} is clipped by the figure's edge"
        boxes.append((t, box))
    colorbar_labels = [(t, b) for t, b in boxes if t.get_text() in ("P", "dL/dP", "dL/dS") and t.get_rotation() == 90]
    assert len(colorbar_labels) == 3
    for i, (t, b) in enumerate(colorbar_labels):
        for u, c in colorbar_labels[i + 1:]:
            assert not b.overlaps(c), f"{t.get_text()!r} runs into {u.get_text()!r}"
