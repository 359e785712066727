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
    titles: Sequence[str] | Sequence[Sequence[str]] | None = None,
    figsize: tuple[float, float] = (2.5, 2.5),
    cmap: str = "Reds",
    *,
    xticklabels: Sequence[str] | None = None,
    yticklabels: Sequence[str] | None = None,
    nan_color: str = "tab:blue",
) -> Figure:
    """Draw a grid of attention-weight heatmaps with one shared colorbar.

    Args:
        matrices: (rows, cols, n, m): a tensor (any device or dtype, with or without grad)
            or anything ``numpy.asarray`` takes; each (n, m) matrix is one heatmap, queries
            down and keys across.
        xlabel: label under the bottom row (usually ``"Keys"``).
        ylabel: label left of the first column (usually ``"Queries"``).
        titles: one title per column (drawn over the top row), or ``rows`` sequences of
            ``cols`` titles (one per heatmap), or None.
        figsize: size of the whole figure in inches.
        cmap: matplotlib colormap name.
        xticklabels: m labels for the keys (e.g. tokens), or None for integer ticks.
        yticklabels: n labels for the queries, or None for integer ticks.
        nan_color: colour of NaN and infinite entries, which the colour scale cannot show;
            when there are any, a legend entry names them.

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot state, works headless) with a layout
        engine ("constrained"), so ``fig.savefig(path)`` saves it whole, labels and titles
        included. The colour scale is fixed to 0..1 so that figures compare.

    Raises:
        TypeError: ``matrices`` is not numeric.
        ValueError: ``matrices`` is not 4-D or has no rows or columns, or titles / tick
            labels of the wrong length.

    Source: D2L ``show_heatmaps`` (section "Attention Cues").

    >>> fig = show_heatmaps(torch.eye(3).reshape(1, 1, 3, 3), "Keys", "Queries")
    >>> len(fig.axes)   # one heatmap and the colorbar
    2
    """
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    array = _as_array(matrices)
    if array.ndim != 4 or 0 in array.shape[:2]:
        raise ValueError(
            "Expected `matrices` of shape (rows, cols, n, m) with rows, cols >= 1, but got "
            f"shape {tuple(array.shape)} instead."
        )
    rows, cols, n, m = array.shape
    grid_titles = _title_grid(titles, rows, cols)
    if xticklabels is not None and len(xticklabels) != m:
        raise ValueError(f"Expected {m} `xticklabels`, but got {len(xticklabels)} instead.")
    if yticklabels is not None and len(yticklabels) != n:
        raise ValueError(f"Expected {n} `yticklabels`, but got {len(yticklabels)} instead.")
    colormap = matplotlib.colormaps[cmap].with_extremes(bad=nan_color)
    fig = Figure(figsize=figsize, layout="constrained")
    axes = fig.subplots(rows, cols, sharex=True, sharey=True, squeeze=False)
    image = None
    for i in range(rows):
        for j in range(cols):
            ax = axes[i, j]
            image = ax.imshow(array[i, j], cmap=colormap, vmin=0.0, vmax=1.0, aspect="auto")
            if i == rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            if grid_titles[i][j]:
                ax.set_title(grid_titles[i][j])
            if xticklabels is not None:
                ax.set_xticks(range(m), labels=list(xticklabels))
            else:  # integer ticks, at least one: a single key or query shows "0"
                ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
            if yticklabels is not None:
                ax.set_yticks(range(n), labels=list(yticklabels))
            else:
                ax.yaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    assert image is not None  # rows, cols >= 1 after the shape check
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.6)
    kinds = [
        name
        for name, present in (("NaN", np.isnan(array).any()), ("inf", np.isinf(array).any()))
        if present
    ]
    if kinds:
        fig.legend(
            handles=[Patch(facecolor=nan_color, label=" / ".join(kinds))],
            loc="outside lower center",
            frameon=False,
        )
    return fig


def _title_grid(
    titles: Sequence[str] | Sequence[Sequence[str]] | None, rows: int, cols: int
) -> list[list[str]]:
    """``rows`` x ``cols`` titles ("" for none) from the forms ``show_heatmaps`` takes."""
    if titles is None:
        return [[""] * cols for _ in range(rows)]
    if all(isinstance(t, str) for t in titles):
        if len(titles) != cols:
            raise ValueError(
                f"Expected {cols} `titles`, one per column, but got {len(titles)} instead."
            )
        return [[str(t) for t in titles]] + [[""] * cols for _ in range(rows - 1)]
    grid = [list(row) for row in titles]
    if len(grid) != rows or any(len(row) != cols for row in grid):
        shape = [len(row) for row in grid]
        raise ValueError(
            f"Expected `titles` as {rows} rows of {cols} titles, one per heatmap, but got "
            f"rows of lengths {shape} instead."
        )
    return [[str(t) for t in row] for row in grid]
