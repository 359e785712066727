"""Heatmaps of attention weights (the textbook's ``show_heatmaps``), for any backend's
tensors; matplotlib is imported when a figure is drawn."""

from __future__ import annotations

from typing import Any

import numpy as np
from keras import ops

__all__ = ["show_heatmaps"]


def show_heatmaps(
    matrices: Any,
    xlabel: str = "Keys",
    ylabel: str = "Queries",
    titles: list[str] | None = None,
    figsize: tuple[float, float] = (2.5, 2.5),
    cmap: str = "Reds",
) -> Any:
    """Draw a grid of heatmaps, one per (row, column) of ``matrices``.

    Args:
        matrices: (rows, cols, n, m), or (n, m) or (cols, n, m) (one row): attention
            weights, e.g. a layer's ``attention_weights`` reshaped; a tensor of any Keras
            backend or a NumPy array.
        xlabel, ylabel: the axes' labels (the last row's x axes, the first column's y axes).
        titles: one title per column, or None.
        figsize: the size of one heatmap, in inches.
        cmap: a matplotlib colour map name.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ValueError: ``matrices`` with fewer than 2 or more than 4 dimensions, or ``titles``
            of another length than the columns.

    Source: D2L "Attention Cues" / "Attention Scoring Functions" (``d2l.show_heatmaps``).
    """
    import matplotlib.pyplot as plt

    data = np.asarray(ops.convert_to_numpy(ops.cast(matrices, "float32")))
    if not 2 <= data.ndim <= 4:
        raise ValueError(
            f"Expected `matrices` of shape (rows, cols, n, m), but got shape {data.shape} instead."
        )
    data = data.reshape((1,) * (4 - data.ndim) + data.shape)
    rows, cols = data.shape[:2]
    if titles is not None and len(titles) != cols:
        raise ValueError(f"Expected {cols} `titles`, but got {len(titles)} instead.")
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(figsize[0] * cols, figsize[1] * rows),
        sharex=True,
        sharey=True,
        squeeze=False,
    )
    image = None
    for i in range(rows):
        for j in range(cols):
            ax = axes[i, j]
            image = ax.imshow(data[i, j], cmap=cmap, vmin=0.0)
            if i == rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            if titles is not None:
                ax.set_title(titles[j])
    fig.colorbar(image, ax=axes, shrink=0.6)
    return fig
