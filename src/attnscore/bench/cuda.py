"""The CUDA rows of issue 10: attnscore against the textbook code, SDPA, flex_attention and
``nn.MultiheadAttention``, fp32 and bf16, with peak CUDA memory.

:func:`cases` takes the device and a shape scale, so the same case list runs on the CPU
at tiny shapes in the tests (``cases(torch.device("cpu"), scale=1/64)``); only
``attnscore bench --device cuda`` runs it at full size.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

import attnscore

from .. import textbook
from ..registry import make_scorer
from ._core import Built, Case, Forward, Shapes, Target, key_mask, lengths, scaled, sdpa_masked

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
FLEX_BLOCK = 128

SOFTMAX: Shapes = {"B": 64, "n": 256, "m": 1024}
DOT: Shapes = {"B": 32, "n": 1024, "m": 1024, "d": 64}
HEADS: Shapes = {"B": 16, "H": 16, "n": 1024, "m": 1024, "d": 64}
ADDITIVE_SMALL: Shapes = {"B": 8, "n": 128, "m": 512, "h": 128, "d": 64}
ADDITIVE_LARGE: Shapes = {"B": 4, "n": 1024, "m": 1024, "h": 256, "d": 64}
MHA: Shapes = {"B": 32, "n": 512, "E": 512, "H": 8}
KEEP = ("d", "H", "E")
"""Sizes a shape scale leaves alone (feature and head sizes)."""


def _free_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return 2**31  # the CPU list runs at test shapes only


def _softmax(s: Shapes, *, dtype: torch.dtype, device: torch.device) -> Built:
    X = torch.randn(s["B"], s["n"], s["m"], device=device, dtype=dtype)
    X_book = X.clone()  # the book's masked_softmax writes -1e6 into its input
    vl = lengths(s["B"], s["m"], device)
    return Built(
        {
            "attnscore": lambda: attnscore.masked_softmax(X, vl),
            "softmax": lambda: torch.softmax(X, -1),
            "textbook": lambda: textbook.masked_softmax(X_book, vl),
        },
        same=("textbook",),
        notes=["softmax = torch.softmax without a mask, the pace to beat"],
    )


def flex_block_mask(valid_lens: Tensor, n: int, m: int, block: int = FLEX_BLOCK) -> object:
    """A flex_attention ``BlockMask`` for key lengths, built from the lengths directly.

    Per batch row b with length L: the first ``L // block`` key blocks are full, block
    ``L // block`` is partial when ``block`` does not divide L (its entries masked by
    ``kv_idx < L``), the rest are skipped. One mask for all heads and query blocks; no
    ``create_block_mask`` (5-7 ms a call uncompiled, issue 10).
    """
    from torch.nn.attention.flex_attention import BlockMask

    B = valid_lens.shape[0]
    q_blocks, kv_blocks = -(-n // block), -(-m // block)
    lens = valid_lens.to(torch.int32)
    full = lens // block
    partial_ = (lens % block != 0).to(torch.int32)
    ar = torch.arange(kv_blocks, device=lens.device, dtype=torch.int32)
    # partial block first, then the rest (entries past the count are ignored)
    part_idx = (full[:, None] + ar[None, :]) % kv_blocks

    def per_q_block(x: Tensor) -> Tensor:
        return x.reshape(B, 1, 1, *x.shape[1:]).expand(B, 1, q_blocks, *x.shape[1:]).contiguous()

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return kv_idx < valid_lens[b]

    return BlockMask.from_kv_blocks(
        per_q_block(partial_[:, None])[..., 0],
        per_q_block(part_idx),
        per_q_block(full[:, None])[..., 0],
        per_q_block(ar.expand(B, kv_blocks)),
        BLOCK_SIZE=block,
        mask_mod=mask_mod,
        seq_lengths=(n, m),
    )


FlexFn = Callable[[Tensor, Tensor, Tensor, Any], Tensor]


def _flex(device: torch.device) -> FlexFn | None:
    """flex_attention, compiled on CUDA (eager elsewhere: test shapes only); None if absent."""
    try:
        from torch.nn.attention.flex_attention import flex_attention
    except ImportError:  # pragma: no cover - torch < 2.5
        return None
    fn: Callable[..., Any] = flex_attention
    if device.type == "cuda":
        fn = torch.compile(flex_attention)

    def call(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # "called without torch.compile()"
            out: Tensor = fn(q, k, v, block_mask=block_mask)
        return out

    return call


def _dot(
    s: Shapes, *, dtype: torch.dtype, device: torch.device, flex: bool, backward: bool
) -> Built:
    B, n, m, d = s["B"], s["n"], s["m"], s["d"]
    heads = (s["H"],) if "H" in s else ()
    q, k, v = (
        torch.randn(B, *heads, x, d, device=device, dtype=dtype, requires_grad=backward)
        for x in (n, m, m)
    )
    vl = lengths(B, m, device)
    ours = make_scorer("scaled_dot", query_size=d).eval()
    forwards: dict[str, Forward] = {
        "attnscore": lambda: ours(q, k, v, vl),
        "sdpa": lambda: sdpa_masked(q, k, v, vl),
    }
    notes = ["sdpa = scaled_dot_product_attention, 4-D layout, boolean mask built per call"]
    # flex_attention has no backward on the CPU (there it only runs in tests)
    fn = _flex(device) if flex and (device.type == "cuda" or not backward) else None
    if fn is not None:

        def flex_forward() -> Tensor:
            mask = flex_block_mask(vl, n, m)
            if heads:
                return fn(q, k, v, mask)
            return fn(q[:, None], k[:, None], v[:, None], mask)[:, 0]

        forwards["flex"] = flex_forward
        notes.append("flex = flex_attention with a block mask built from the lengths per call")
    if not heads:
        book = textbook.DotProductAttention(0.0).eval()
        forwards["textbook"] = lambda: book(q, k, v, vl)
    return Built(
        forwards,
        grad_inputs={name: [q, k, v] for name in forwards},
        same=("sdpa", "flex", "textbook"),
        notes=notes,
    )


def _additive(s: Shapes, *, backward: bool, device: torch.device) -> Built:
    B, n, m, h, d = s["B"], s["n"], s["m"], s["h"], s["d"]
    q, k, v = (torch.randn(B, x, d, device=device) for x in (n, m, m))
    vl = lengths(B, m, device)
    ours = make_scorer("additive", query_size=d, key_size=d, num_hiddens=h).to(device).eval()
    modules: dict[str, nn.Module] = {"attnscore": ours}
    notes = []
    # The book keeps (B, n, m, h) features, their tanh and its gradient: about 3 tensors
    # of that size in fwd+bwd, 2 in the forward.
    need = (3 if backward else 2) * B * n * m * h * 4
    free = _free_bytes(device)
    if need < 0.9 * free:
        book = textbook.AdditiveAttention(d, d, h, 0.0).to(device).eval()
        book.load_state_dict(ours.state_dict(), strict=True)
        modules["textbook"] = book
    else:
        notes.append(
            f"textbook skipped: its (B, n, m, h) tensors need about {need / 2**30:.1f} GiB, "
            f"{free / 2**30:.1f} GiB free"
        )

    def forward(mod: nn.Module) -> Forward:
        return lambda: mod(q, k, v, vl)

    return Built(
        {name: forward(mod) for name, mod in modules.items()},
        grad_inputs={name: list(mod.parameters()) for name, mod in modules.items()},
        same=("textbook",),
        notes=notes,
    )


def _mha(s: Shapes, *, autocast: bool, device: torch.device) -> Built:
    B, n, E, H = s["B"], s["n"], s["E"], s["H"]
    x = torch.randn(B, n, E, device=device)
    vl = lengths(B, n, device)
    ours = attnscore.MultiHeadAttention(E, H).to(device).eval()
    with torch.no_grad():
        ours(x, x, x, vl)  # materialize the lazy projections
    torch_mha = nn.MultiheadAttention(E, H, bias=False, batch_first=True).to(device).eval()
    with torch.no_grad():
        w = torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight])
        torch_mha.in_proj_weight.copy_(w)
        torch_mha.out_proj.weight.copy_(ours.W_o.weight)
    padding = ~key_mask(vl, n)  # True = ignore, torch's convention

    def run(fn: Forward) -> Forward:
        def forward() -> Tensor:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                return fn()

        return forward

    def theirs() -> Tensor:
        out: Tensor
        out, _ = torch_mha(x, x, x, key_padding_mask=padding, need_weights=False)
        return out

    return Built(
        {"attnscore": run(lambda: ours(x, x, x, vl)), "torch_mha": run(theirs)},
        grad_inputs={
            "attnscore": list(ours.parameters()),
            "torch_mha": list(torch_mha.parameters()),
        },
        same=("torch_mha",),
        notes=["torch_mha = nn.MultiheadAttention(bias=False) with key_padding_mask"],
    )


def cases(device: torch.device, scale: float = 1.0, *, flex: bool | None = None) -> list[Case]:
    """The issue-10 case list on ``device``, batch and sequence sizes times ``scale``.

    Args:
        device: where to run (``cuda`` for the real rows; ``cpu`` for tests).
        scale: multiplies B, n, m and h (at least 1 each); feature and head sizes stay.
        flex: include flex_attention rows; default: on CUDA only (on the CPU it runs
            uncompiled, for tests).
    """
    flex = device.type == "cuda" if flex is None else flex
    out: list[Case] = []

    def add(
        name: str,
        shapes: Shapes,
        dtype: str,
        build: Callable[[Shapes], Built],
        targets: list[Target],
        backward: bool = False,
    ) -> None:
        s = scaled(shapes, scale, KEEP)
        out.append(Case(name, s, dtype, partial(build, s), targets, backward=backward))

    for dt in DTYPES:
        add(
            "masked_softmax",
            SOFTMAX,
            dt,
            partial(_softmax, dtype=DTYPES[dt], device=device),
            [Target("time", 0.8, "softmax")],
        )
    for backward in (False, True):
        for dt in DTYPES:
            add(
                "dot_fwd_bwd" if backward else "dot_fwd",
                DOT,
                dt,
                partial(_dot, dtype=DTYPES[dt], device=device, flex=flex, backward=backward),
                [Target("time", 1.0, "sdpa"), Target("peak", 2.0, "sdpa")],
                backward,
            )
    add(
        "dot_heads_fwd",
        HEADS,
        "bfloat16",
        partial(_dot, dtype=torch.bfloat16, device=device, flex=flex, backward=False),
        [Target("time", 0.7, "sdpa"), Target("peak", 2.0, "sdpa")],
    )
    for shapes, bwd_bound, fwd_bound, peak in (
        (ADDITIVE_SMALL, 0.2, 0.125, None),
        (ADDITIVE_LARGE, 0.2, None, 256.0),
    ):
        for backward in (True, False):
            bound = bwd_bound if backward else fwd_bound
            targets = [] if bound is None else [Target("time", bound, "textbook")]
            if peak is not None and backward:
                targets.append(Target("peak_mib", peak))
            add(
                "additive_fwd_bwd" if backward else "additive_fwd",
                shapes,
                "float32",
                partial(_additive, backward=backward, device=device),
                targets,
                backward,
            )
    for dt, autocast in (("float32", False), ("bf16 autocast", True)):
        add(
            "multihead_fwd_bwd",
            MHA,
            dt,
            partial(_mha, autocast=autocast, device=device),
            [Target("time", 1.1, "torch_mha")],
            True,
        )
    return out


def describe(device: torch.device) -> str:
    """One line naming the GPU (or CPU), torch and CUDA versions."""
    from ._core import device_name

    cuda = torch.version.cuda
    return f"{device_name(device)}, torch {torch.__version__}" + (f", CUDA {cuda}" if cuda else "")
