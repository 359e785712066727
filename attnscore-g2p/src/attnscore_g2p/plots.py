"""Every figure of the G2P task, built as ``matplotlib.figure.Figure`` objects (no pyplot).

Figures are returned, never shown; commands save them with
:func:`attnscore.cli._files.save_figure`. No backend is selected here: a bare ``Figure``
renders to files on any machine, headless included.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from attnscore.plotting import show_heatmaps

from .data import EOS
from .state import AttentionStats

if TYPE_CHECKING:
    from matplotlib.figure import Figure


def words_figure(
    words: Sequence[str],
    prons: Sequence[Sequence[str]],
    atts: Sequence[torch.Tensor],
    title: str | None = None,
) -> Figure:
    """One figure, one heatmap panel per word: its decoded phonemes ``prons`` (and
    ``</s>``) down, its letters across, coloured by its (len(pron) + 1, len(word)) float
    attention weights ``atts``; ``title`` above (e.g. the scorer's name).

    Raises:
        ValueError: lists of different lengths, or weights of the wrong shape.
    """
    from matplotlib.figure import Figure

    if not (len(words) == len(prons) == len(atts)) or not words:
        raise ValueError(
            f"Expected as many words, pronunciations and weights (at least one), but got "
            f"{len(words)}, {len(prons)} and {len(atts)} instead"
        )
    for w, p, a in zip(words, prons, atts, strict=True):
        if tuple(a.shape) != (len(p) + 1, len(w)):
            raise ValueError(
                f"Expected weights of shape {(len(p) + 1, len(w))} for {w!r}, but got "
                f"{tuple(a.shape)} instead"
            )
    widths = [len(w) + 1.5 for w in words]
    height = max(len(p) + 1 for p in prons)
    fig = Figure(figsize=(0.35 * sum(widths) + 1.2, 0.35 * height + 1.4))
    axes = fig.subplots(1, len(words), squeeze=False, gridspec_kw={"width_ratios": widths})[0]
    image: Any = None
    for ax, w, p, a in zip(axes, words, prons, atts, strict=True):
        image = ax.imshow(a.float().cpu().numpy(), cmap="Reds", vmin=0.0, vmax=1.0)
        ax.set_xticks(range(len(w)), list(w))
        ax.set_yticks(range(len(p) + 1), [*p, EOS])
        ax.set_xlabel("letters")
        ax.set_title(w)
    axes[0].set_ylabel("phonemes")
    fig.colorbar(image, ax=list(axes), shrink=0.8)
    if title:
        # Just above the panels' titles: square cells leave the panels shorter than their
        # grid cells, and a title at the figure's top would float over an empty band.
        for ax in axes:
            ax.apply_aspect()
        top = max(ax.get_position().y1 for ax in axes)
        fig.suptitle(title, y=min(1.0, top + 0.4 / fig.get_figheight()), va="bottom")
    return fig


def alignments_figure(
    mats: Sequence[torch.Tensor], titles: Sequence[str], word: str, pron: Sequence[str]
) -> Figure:
    """The attention of one word under several models side by side: per model its
    (len(pron) + 1, len(word)) float weights ``mats`` and its panel title ``titles`` (the
    scorer's name)."""
    return show_heatmaps(
        torch.stack([m.float().cpu() for m in mats])[None],
        xlabel="letters",
        ylabel="phonemes",
        titles=list(titles),
        figsize=(len(mats) * (0.3 * len(word) + 1.2), 0.3 * (len(pron) + 1) + 1.4),
        xticklabels=list(word),
        yticklabels=[*pron, EOS],
    )


def comparison_figure(rows: Sequence[dict[str, Any]]) -> Figure:
    """Bar chart of test PER and WER (beam search) per scorer, mean with ± std error bars, of
    the ``rows`` of :func:`attnscore_g2p.compare.summarize`."""
    from matplotlib.figure import Figure

    names = [r["scoring"] for r in rows]
    fig = Figure(figsize=(8, 3), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, key, label in zip(axes, ("per_beam", "wer_beam"), ("PER (%)", "WER (%)"), strict=True):
        means = [100 * r[key]["mean"] for r in rows]
        stds = [100 * (r[key]["std"] or 0.0) for r in rows]  # one seed: no spread to draw
        ax.bar(names, means, yerr=stds, capsize=4, color="tab:red")
        ax.set_ylabel(f"test {label}")
        ax.tick_params(axis="x", rotation=30)
    return fig


def attention_figure(runs: Mapping[str, Sequence[Sequence[AttentionStats]]]) -> Figure:
    """The attention's score spread, entropy and peak weight along training, per scorer.

    One line per scorer: the mean over its runs (seeds) at each recorded step, with the
    runs' range shaded; the steps are those every run of the scorer recorded. ``runs``:
    scorer label -> one :class:`~attnscore_g2p.state.AttentionStats` list per run (as in
    ``summary.json``'s ``attention``).
    """
    from matplotlib.figure import Figure

    panels = (
        ("score_std", "score std over a word's letters", "log"),
        ("entropy", "attention entropy (nats)", "linear"),
        ("max_weight", "largest weight of a row", "linear"),
    )
    fig = Figure(figsize=(12, 3.2), layout="constrained")
    axes = fig.subplots(1, len(panels))
    for label, stats in runs.items():
        steps = sorted(set.intersection(*({s.step for s in run} for run in stats)))
        for ax, (key, _, _) in zip(axes, panels, strict=True):
            values = torch.tensor(
                [[getattr(s, key) for s in run if s.step in steps] for run in stats],
                dtype=torch.float64,
            )
            (line,) = ax.plot(steps, values.mean(0).tolist(), label=label, marker=".")
            if len(stats) > 1:
                low, high = values.amin(0).tolist(), values.amax(0).tolist()
                ax.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
    for ax, (_, title, scale) in zip(axes, panels, strict=True):
        ax.set_yscale(scale)
        ax.set_xlabel("optimizer step")
        ax.set_title(title, fontsize=10)
    axes[0].legend(fontsize=8)
    return fig
