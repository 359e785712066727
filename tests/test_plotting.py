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
