"""``attnscore demo``: the worked examples and exercises of D2L "Attention Scoring
Functions", computed.

:func:`run_demo` prints each example and writes its heatmap; the ``demo`` command (added
by :func:`add_parser`) calls it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

from ..masking import masked_softmax
from ..modules import AdditiveAttention, Attention, DotProductAttention, MultiplicativeAttention
from ..plotting import show_heatmaps
from ._files import FIGURE_FORMATS, check_folder, save_figure
from ._usage import ArgumentParser, add_overwrite

__all__ = ["FIGURES", "add_parser", "run_demo", "toy_inputs"]

FIGURES = (
    "additive_attention",
    "dot_product_attention",
    "exercise1_additive",
    "exercise1_dot",
    "exercise2_general",
    "exercise3_summation",
)
"""The names (without extension) of the heatmaps :func:`run_demo` writes."""


def add_parser(subparsers: argparse._SubParsersAction[ArgumentParser]) -> ArgumentParser:
    """Add ``attnscore demo`` to ``subparsers`` (what ``add_subparsers()`` returns) and
    return its parser, whose ``handler`` default runs :func:`run_demo`.

    >>> parser = ArgumentParser(prog="attnscore")
    >>> _ = add_parser(parser.add_subparsers())
    >>> parser.parse_args(["demo", "--format", "svg"]).format
    'svg'
    """
    demo = subparsers.add_parser("demo", help="run the section's worked examples and draw heatmaps")
    demo.add_argument(
        "--out",
        type=Path,
        default=Path("attnscore-demo"),
        help="folder for the heatmaps, created if missing; its parent must exist "
        "(default: ./attnscore-demo)",
    )
    demo.add_argument(
        "--format",
        choices=[f.lstrip(".") for f in FIGURE_FORMATS],
        default="png",
        help="figure format (default: %(default)s)",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    add_overwrite(demo, "heatmaps of an earlier demo in --out")
    demo.set_defaults(handler=_command)
    return demo


def _command(args: argparse.Namespace) -> int:
    """The handler of ``attnscore demo``: 0, or a UsageError for an unusable ``--out`` (a
    file, a missing parent, or heatmaps there already, without ``--overwrite``)."""
    suffix = f".{args.format}"
    out = check_folder(
        args.out, "--out", files=[f"{name}{suffix}" for name in FIGURES], overwrite=args.overwrite
    )
    written = run_demo(out, seed=args.seed, suffix=suffix, overwrite=args.overwrite)
    print(f"\nwrote {len(written)} heatmaps into {out}/")
    return 0


def toy_inputs(
    query_size: int, generator: torch.Generator
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The section's toy example: queries N(0, 1) (2, 1, query_size), keys all ones
    (2, 10, 2), values arange(40) as (2, 10, 4), valid_lens [2, 6].

    Args:
        query_size: the queries' feature size.
        generator: draws the queries.

    Returns:
        ``(queries, keys, values, valid_lens)``.

    >>> [tuple(t.shape) for t in toy_inputs(20, torch.Generator().manual_seed(0))]
    [(2, 1, 20), (2, 10, 2), (2, 10, 4), (2,)]
    """
    queries = torch.randn(2, 1, query_size, generator=generator)
    keys = torch.ones(2, 10, 2)
    values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
    return queries, keys, values, torch.tensor([2, 6])


def _fmt(t: Tensor) -> str:
    return str(t.detach().numpy().round(4)).replace("\n", "\n    ")


def run_demo(
    out_dir: Path,
    seed: int = 0,
    echo: Callable[[str], None] = print,
    *,
    suffix: str = ".png",
    overwrite: bool = False,
) -> list[Path]:
    """Run every worked example; print results; write heatmaps into ``out_dir``.

    ``out_dir`` is created if missing, but not its parents. Figures (:data:`FIGURES`) are
    written in the format ``suffix`` names (``.png``, ``.pdf`` or ``.svg``), each
    atomically, with the umask's file mode.

    Args:
        out_dir: the folder of the heatmaps.
        seed: seeds the random inputs and parameters.
        echo: prints one block of text.
        suffix: the figures' extension.
        overwrite: replace figures already in ``out_dir``.

    Returns:
        The paths of the files written.

    Raises:
        FileNotFoundError: the parent of ``out_dir`` does not exist.
        attnscore.cli._usage.UsageError: ``suffix`` is not a figure format, or a figure
            cannot be written (or exists, and ``overwrite`` is false).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder:
    ...     paths = run_demo(Path(folder), echo=lambda line: None)
    >>> sorted(p.name for p in paths)[:2]
    ['additive_attention.png', 'dot_product_attention.png']
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(exist_ok=True)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    written: list[Path] = []

    def heatmap(name: str, weights: Tensor, title: str) -> None:
        # As in the book: all (batch, query) rows stacked into one matrix.
        assert name in FIGURES, name
        grid = weights.reshape(1, 1, -1, weights.shape[-1])
        fig = show_heatmaps(grid, "Keys", "Queries", titles=[title], figsize=(4.0, 2.5))
        path = out_dir / f"{name}{suffix}"
        save_figure(fig, path, "--out", overwrite=overwrite)
        written.append(path)
        echo(f"    heatmap: {path}")

    echo("== Masked softmax ==")
    X = torch.rand(2, 2, 4, generator=gen)
    echo(f"valid_lens [2, 3]:\n    {_fmt(masked_softmax(X, torch.tensor([2, 3])))}")
    echo(
        "valid_lens [[1, 3], [2, 4]]:\n    "
        + _fmt(masked_softmax(X, torch.tensor([[1, 3], [2, 4]])))
    )
    echo(
        f"valid_lens [0, 4] (a row with no valid key is all zeros):\n"
        f"    {_fmt(masked_softmax(X, torch.tensor([0, 4])))}"
    )

    echo("\n== Additive attention, toy example (eval mode) ==")
    queries, keys, values, valid_lens = toy_inputs(20, gen)
    additive = AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1).eval()
    echo(f"output:\n    {_fmt(additive(queries, keys, values, valid_lens))}")
    heatmap("additive_attention", additive.attention_weights, "additive")  # type: ignore[arg-type]

    echo("\n== Scaled dot-product attention, toy example (eval mode) ==")
    dot_queries = torch.randn(2, 1, 2, generator=gen)
    dot = DotProductAttention(dropout=0.5).eval()
    echo(f"output:\n    {_fmt(dot(dot_queries, keys, values, valid_lens))}")
    heatmap("dot_product_attention", dot.attention_weights, "scaled dot")  # type: ignore[arg-type]

    echo("\n== Exercise 1: random keys ==")
    random_keys = torch.randn(2, 10, 2, generator=gen)
    additive(queries, random_keys, values, valid_lens)
    dot(dot_queries, random_keys, values, valid_lens)
    w_add, w_dot = additive.attention_weights, dot.attention_weights
    assert w_add is not None and w_dot is not None
    echo(f"additive weights:\n    {_fmt(w_add)}")
    echo(f"scaled dot-product weights:\n    {_fmt(w_dot)}")
    gap = (w_add - w_dot).abs().max().item()
    echo(
        f"largest difference between the two: {gap:.4f}. With equal keys every key scored "
        "the same, so both gave uniform weights over the valid keys; distinct keys get "
        "distinct scores, and the two scoring functions rank them differently (additive "
        "passes q and k through learned W_q, W_k and a tanh; dot product compares them "
        "directly), so the weights differ."
    )
    heatmap("exercise1_additive", w_add, "additive, random keys")
    heatmap("exercise1_dot", w_dot, "scaled dot, random keys")

    echo(
        "\n== Exercise 2: general scoring q^T W k, queries (20) and keys (2) of different "
        "sizes, matrix products only =="
    )
    general = MultiplicativeAttention(query_size=20, key_size=2).eval()
    echo(f"toy example output:\n    {_fmt(general(queries, keys, values, valid_lens))}")
    general(queries, random_keys, values, valid_lens)
    w_gen = general.attention_weights
    assert w_gen is not None
    echo(f"weights with random keys:\n    {_fmt(w_gen)}")
    heatmap("exercise2_general", w_gen, "general, random keys")

    echo("\n== Exercise 3: vector summation a(q, k) = 1ᵀ(q + k) vs dot product ==")
    d = 2
    two_queries = torch.tensor([[[1.0, 0.0], [-1.0, 0.5]]])  # two different queries
    one_keys = random_keys[:1]
    one_values = values[:1]
    summation = Attention(lambda q, k: q.sum(-1, keepdim=True) + k.sum(-1).unsqueeze(-2))
    summation(two_queries, one_keys, one_values)
    dot(two_queries, one_keys, one_values)
    w_sum, w_dot2 = summation.attention_weights, dot.attention_weights
    assert w_sum is not None and w_dot2 is not None
    echo(f"summation weights for two different queries:\n    {_fmt(w_sum)}")
    echo(f"dot-product weights for the same queries:\n    {_fmt(w_dot2)}")
    same = torch.allclose(w_sum[0, 0], w_sum[0, 1])
    echo(
        f"summation gives the same weights for every query: {same}. The query adds one "
        "constant to a whole row of scores and softmax cancels it, so the weights depend "
        "on the keys alone: summation cannot express how well a key matches a query. "
        "The dot product does (its rows differ by "
        f"{(w_dot2[0, 0] - w_dot2[0, 1]).abs().max():.4f}); "
        f"its variance grows with d, which the 1/sqrt(d) = {1 / math.sqrt(d):.4f} scale undoes."
    )
    heatmap("exercise3_summation", w_sum, "summation")
    return written
