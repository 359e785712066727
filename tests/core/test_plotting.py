"""show_heatmaps: figure structure, colour scale, labels, inputs and errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from matplotlib.figure import Figure

from attnscore import show_heatmaps


def test_grid_shared_colorbar_fixed_scale(tmp_path):
    w = torch.softmax(torch.randn(2, 3, 4, 5), -1).requires_grad_(True)
    fig = show_heatmaps(w, "Keys", "Queries", titles=["a", "b", "c"])
    assert isinstance(fig, Figure)
    assert len(fig.axes) == 2 * 3 + 1  # six heatmaps and one colorbar
    images = [ax.images[0] for ax in fig.axes[:6]]
    assert all(im.get_clim() == (0.0, 1.0) for im in images)
    np.testing.assert_allclose(images[4].get_array(), w[1, 1].detach().numpy())
    assert [fig.axes[j].get_title() for j in range(3)] == ["a", "b", "c"]
    assert fig.axes[3].get_xlabel() == "Keys" and fig.axes[0].get_ylabel() == "Queries"
    fig.savefig(tmp_path / "h.png")
    assert (tmp_path / "h.png").stat().st_size > 1000


def test_tick_labels_and_numpy_input():
    fig = show_heatmaps(
        np.eye(3).reshape(1, 1, 3, 3),
        "Letters",
        "Phonemes",
        xticklabels=list("cat"),
        yticklabels=["K", "AE", "T"],
    )
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["c", "a", "t"]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["K", "AE", "T"]


def test_bfloat16_tensor_input():
    fig = show_heatmaps(torch.full((1, 1, 2, 2), 0.5, dtype=torch.bfloat16), "k", "q")
    assert fig.axes[0].images[0].get_array().max() == 0.5


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"matrices": torch.rand(3, 4)}, ValueError, r"\(rows, cols, n, m\).*\(3, 4\)"),
        ({"matrices": torch.rand(1, 2, 3, 4), "titles": ["x"]}, ValueError, "2 `titles`"),
        ({"matrices": torch.rand(1, 1, 3, 4), "xticklabels": ["a"]}, ValueError, "4 `xticklabels`"),
        ({"matrices": torch.rand(1, 1, 3, 4), "yticklabels": ["a"]}, ValueError, "3 `yticklabels`"),
        ({"matrices": [["a"]]}, TypeError, "matrices"),
    ],
)
def test_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        show_heatmaps(xlabel="Keys", ylabel="Queries", **kwargs)


def _render(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    return canvas.get_renderer(), np.asarray(canvas.buffer_rgba())


def _shown_ticklabels(ax):
    """Tick labels inside the view (the locator also places some just outside it)."""
    shown = []
    for axis, (low, high) in ((ax.xaxis, sorted(ax.get_xlim())), (ax.yaxis, sorted(ax.get_ylim()))):
        shown += [t.label1 for t in axis.get_major_ticks() if low <= t.get_loc() <= high]
    return shown


def _inside(extent, box):
    return (
        extent.x0 >= box.x0 - 0.5
        and extent.y0 >= box.y0 - 0.5
        and extent.x1 <= box.x1 + 0.5
        and extent.y1 <= box.y1 + 0.5
    )


@pytest.mark.parametrize(
    ("shape", "figsize"),
    [((1, 1, 2, 10), (2.5, 2.5)), ((3, 1, 1, 10), (4.0, 6.0)), ((2, 3, 4, 5), (2.5, 2.5))],
)
def test_plain_savefig_keeps_labels_and_titles_inside(tmp_path, shape, figsize):
    # The README's example: fig.savefig(path) with no bbox_inches must not clip labels.
    cols = shape[1]
    titles = [f"example {j}" for j in range(cols)]
    fig = show_heatmaps(torch.rand(shape), "Keys", "Queries", titles=titles, figsize=figsize)
    renderer, _ = _render(fig)
    texts = [ax.xaxis.label for ax in fig.axes[:-1]] + [ax.yaxis.label for ax in fig.axes[:-1]]
    texts += [ax.title for ax in fig.axes[:-1]]
    texts += [t for ax in fig.axes[:-1] for t in _shown_ticklabels(ax)]
    drawn = [t for t in texts if t.get_visible() and t.get_text()]
    assert {"Keys", "Queries", "example 0"} <= {t.get_text() for t in drawn}
    outside = [t.get_text() for t in drawn if not _inside(t.get_window_extent(renderer), fig.bbox)]
    assert outside == []


def test_one_query_has_one_integer_tick_and_a_label():
    fig = show_heatmaps(torch.rand(1, 1, 1, 6), "Keys", "Queries")
    ax = fig.axes[0]
    _render(fig)
    low, high = sorted(ax.get_ylim())
    shown = [t for t in ax.get_yticks() if low <= t <= high]
    assert shown == [0.0]
    xshown = [t for t in ax.get_xticks() if min(ax.get_xlim()) <= t <= max(ax.get_xlim())]
    assert all(float(t).is_integer() for t in xshown) and len(xshown) >= 2
    assert ax.get_ylabel() == "Queries"


def test_nan_drawn_in_its_own_colour_with_a_legend_entry():
    from matplotlib.colors import to_rgba

    w = torch.full((1, 1, 2, 3), 0.0)
    w[0, 0, 1, 2] = float("nan")
    fig = show_heatmaps(w, "Keys", "Queries", figsize=(3.0, 3.0), nan_color="tab:blue")
    _, pixels = _render(fig)
    ax = fig.axes[0]
    height = pixels.shape[0]

    def colour_at(row, col):
        x, y = ax.transData.transform((col, row))
        return pixels[round(height - y), round(x)] / 255.0

    expected = np.array(to_rgba("tab:blue"))
    np.testing.assert_allclose(colour_at(1, 2), expected, atol=0.02)
    # Zero weight stays the colormap's lowest colour, unlike NaN.
    assert np.abs(colour_at(0, 0) - expected).max() > 0.2
    labels = [t.get_text() for legend in fig.legends for t in legend.get_texts()]
    assert labels == ["NaN"]


def test_no_legend_without_nan():
    fig = show_heatmaps(torch.rand(1, 1, 2, 3), "Keys", "Queries")
    assert fig.legends == []


def test_per_heatmap_titles_and_their_errors():
    fig = show_heatmaps(torch.rand(2, 1, 2, 3), "k", "q", titles=[["first"], ["second"]])
    assert [fig.axes[i].get_title() for i in range(2)] == ["first", "second"]
    with pytest.raises(ValueError, match="2 rows of 1 titles"):
        show_heatmaps(torch.rand(2, 1, 2, 3), "k", "q", titles=[["only one"]])
