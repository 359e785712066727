"""Heatmaps of attention weights (matplotlib, imported only when a figure is drawn)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["show_heatmaps"]


def _as_array(matrices: Any) -> np.ndarray:
    if isinstance(matrices, torch.Tensor):
        return matrices.detach().to("cpu", torch.float64).numpy()
    try:
        array = np.asarray(matrices, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(
            "Expected `matrices` to be a tensor or array of numbers, but got "
            f"{type(matrices).__name__} instead."
        ) from err
    return array


def show_heatmaps(
    matrices: Any,
    xlabel: str,
    ylabel: str,
    titles: Sequence[str] | None = None,
    figsize: tuple[float, float] = (2.5, 2.5),
    cmap: str = "Reds",
    *,
    xticklabels: Sequence[str] | None = None,
    yticklabels: Sequence[str] | None = None,
) -> Figure:
    """Draw a grid of attention-weight heatmaps with one shared colorbar.

    Args:
        matrices: (rows, cols, n, m): a tensor (any device or dtype, with or without grad)
            or anything ``numpy.asarray`` takes; each (n, m) matrix is one heatmap, queries
            down and keys across.
        xlabel: label under the bottom row (usually ``"Keys"``).
        ylabel: label left of the first column (usually ``"Queries"``).
        titles: one title per column, or None.
        figsize: size of the whole figure in inches.
        cmap: matplotlib colormap name.
        xticklabels: m labels for the keys (e.g. tokens), or None for numbers.
        yticklabels: n labels for the queries, or None.

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot state, works headless); the colour scale
        is fixed to 0..1 so that figures compare. Save it with ``fig.savefig(path)``.

    Raises:
        TypeError: ``matrices`` is not numeric.
        ValueError: ``matrices`` is not 4-D or has no rows or columns, or titles / tick
            labels of the wrong length.

    Source: D2L ``show_heatmaps`` (section "Attention Cues").

    >>> fig = show_heatmaps(torch.eye(3).reshape(1, 1, 3, 3), "Keys", "Queries")
    >>> len(fig.axes)   # one heatmap and the colorbar
    2
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    array = _as_array(matrices)
    if array.ndim != 4 or 0 in array.shape[:2]:
        raise ValueError(
            "Expected `matrices` of shape (rows, cols, n, m) with rows, cols >= 1, but got "
            f"shape {tuple(array.shape)} instead."
        )
    rows, cols, n, m = array.shape
    if titles is not None and len(titles) != cols:
        raise ValueError(
            f"Expected {cols} `titles`, one per column, but got {len(titles)} instead."
        )
    if xticklabels is not None and len(xticklabels) != m:
        raise ValueError(f"Expected {m} `xticklabels`, but got {len(xticklabels)} instead.")
    if yticklabels is not None and len(yticklabels) != n:
        raise ValueError(f"Expected {n} `yticklabels`, but got {len(yticklabels)} instead.")
    fig = Figure(figsize=figsize)
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    image = None
    for i in range(rows):
        for j in range(cols):
            ax = axes[i, j]
            image = ax.imshow(array[i, j], cmap=cmap, vmin=0.0, vmax=1.0, aspect="auto")
            if i == rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            if titles is not None and i == 0:
                ax.set_title(titles[j])
            if xticklabels is not None:
                ax.set_xticks(range(m), labels=list(xticklabels))
            else:
                ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if yticklabels is not None:
                ax.set_yticks(range(n), labels=list(yticklabels))
            else:
                ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    assert image is not None  # rows, cols >= 1 after the shape check
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6)
    return fig
