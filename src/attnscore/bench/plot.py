"""A figure of a bench run: each cell's time ratio against its PyTorch baseline.

One panel per step (forward, forward + backward), one line per row, one dot per cell
(colour: dtype), on a log scale with 1.0 (as fast as PyTorch) marked: dots left of the
line are cells where attnscore is faster. The ratio is the cell's first time target, the
median over interleaved rounds of attnscore's time over the baseline's. matplotlib is
imported only when a figure is drawn.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ratio_figure", "time_ratios"]

STEPS = ("fwd", "fwd+bwd")
DTYPE_COLORS = {"float32": "tab:blue", "bfloat16": "tab:orange", "float16": "tab:green"}


def time_ratios(result: dict[str, Any]) -> dict[str, list[tuple[str, str, float]]]:
    """Per step, ``(row, dtype, ratio)`` for each cell with a measured time ratio, in the
    run's order (the first time target of the cell: its PyTorch baseline).

    >>> rows = [{"case": "dot", "dtype": "float32", "step": "fwd",
    ...          "targets": [{"kind": "peak", "value": 0.9}, {"kind": "time", "value": 0.5}]},
    ...         {"case": "additive_memory", "dtype": "float32", "step": "fwd+bwd",
    ...          "targets": [{"kind": "rss_mib", "value": 300.0}]}]
    >>> time_ratios({"rows": rows})
    {'fwd': [('dot', 'float32', 0.5)], 'fwd+bwd': []}
    """
    found: dict[str, list[tuple[str, str, float]]] = {step: [] for step in STEPS}
    for row in result["rows"]:
        times = [c for c in row["targets"] if c["kind"] == "time" and c["value"] is not None]
        if times:
            found.setdefault(row["step"], []).append((row["case"], row["dtype"], times[0]["value"]))
    return found


def _title(result: dict[str, Any]) -> str:
    where = str(result.get("device_name", result.get("device", "?")))
    if "torch" not in where:  # runs name the torch build in device_name already
        where += f", torch {result.get('torch')}"
    kind = "quick run (small shapes)" if result.get("quick") else "full run"
    busy = " - machine busy (load above cores)" if result.get("load", {}).get("busy") else ""
    return f"attnscore bench, {kind}: {where}, {result.get('threads')} threads{busy}"


def ratio_figure(result: dict[str, Any]) -> Figure:
    """The time ratios of a bench run (what ``attnscore bench --json`` writes).

    Args:
        result: the run's results: a dict with ``"rows"``, each with ``"case"``,
            ``"dtype"``, ``"step"`` and ``"targets"``.

    Returns:
        A ``matplotlib.figure.Figure`` (no pyplot state, works headless).

    Raises:
        ValueError: no cell of ``result`` has a time ratio.

    >>> rows = [{"case": r, "dtype": "float32", "step": s, "targets": [
    ...     {"kind": "time", "value": v}]} for r, s, v in [("dot", "fwd", 0.5),
    ...     ("dot", "fwd+bwd", 0.8), ("multihead", "fwd", 1.2)]]
    >>> fig = ratio_figure({"rows": rows, "device_name": "x86_64", "torch": "2.13.0"})
    >>> [ax.get_xscale() for ax in fig.axes]
    ['log', 'log']
    """
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    ratios = time_ratios(result)
    steps = [s for s in ratios if ratios[s]]
    if not steps:
        raise ValueError("Expected a bench result with at least one time ratio, but got none")
    names = list(dict.fromkeys(name for s in steps for name, _, _ in ratios[s]))
    y = {name: i for i, name in enumerate(names)}
    values = [v for s in steps for _, _, v in ratios[s]]
    low, high = min(*values, 1.0) / 1.5, max(*values, 1.0) * 1.5
    fig = Figure(figsize=(5 * len(steps) + 1.5, 0.3 * len(names) + 1.6), layout="constrained")
    axes = fig.subplots(1, len(steps), sharey=True, squeeze=False)[0]
    for ax, step in zip(axes, steps, strict=True):
        for name, dtype, value in ratios[step]:
            ax.plot(value, y[name], "o", ms=5, alpha=0.75, color=DTYPE_COLORS.get(dtype, "grey"))
        ax.axvline(1.0, color="black", lw=1)
        ax.set_xscale("log")
        ax.set_xlim(low, high)
        ax.set_title({"fwd": "forward", "fwd+bwd": "forward + backward"}.get(step, step))
        ax.set_xlabel("time / PyTorch baseline (median of per-round ratios; < 1: faster)")
        ax.grid(axis="x", which="both", alpha=0.3)
    axes[0].set_yticks(range(len(names)), names)
    axes[0].invert_yaxis()
    dtypes = list(dict.fromkeys(d for s in steps for _, d, _ in ratios[s]))
    handles = [
        Line2D([], [], ls="", marker="o", color=DTYPE_COLORS.get(d, "grey"), label=d)
        for d in dtypes
    ]
    axes[-1].legend(handles=handles, loc="lower right", fontsize="small")
    fig.suptitle(_title(result), fontsize="medium")
    return fig
