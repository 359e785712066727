"""The implementations each bench row compares, built once for the CPU and the CUDA rows.

Each builder makes its inputs (valid lengths uniform in [1, m], fixed seed) and returns a
:class:`~attnscore.bench._core.Built`: attnscore (scorers from the registry), the book's
code (:mod:`attnscore.textbook`, same parameters) and PyTorch's own (softmax, SDPA,
flex_attention, ``nn.MultiheadAttention``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import attnscore

from .. import textbook
from ..registry import make_scorer
from ._core import Built, Forward, Shapes, key_mask, lengths, sdpa_masked

FLEX_BLOCK = 128

# The shapes of issues 9 and 10.
SOFTMAX: Shapes = {"B": 64, "n": 256, "m": 1024}
DOT: Shapes = {"B": 32, "n": 1024, "m": 1024, "d": 64}
HEADS: Shapes = {"B": 16, "H": 16, "n": 1024, "m": 1024, "d": 64}
ADDITIVE_SMALL: Shapes = {"B": 8, "n": 128, "m": 512, "h": 128, "d": 64}
ADDITIVE_LARGE: Shapes = {"B": 4, "n": 1024, "m": 1024, "h": 256, "d": 64}
MHA: Shapes = {"B": 32, "n": 512, "E": 512, "H": 8}


def free_bytes(device: torch.device) -> int:
    """Bytes free on ``device``: CUDA's free memory, or the CPU's available pages."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def softmax(s: Shapes, *, dtype: torch.dtype, device: torch.device) -> Built:
    """Masked softmax (B, n, m) by lengths: attnscore, unmasked ``torch.softmax``, the book."""
    torch.manual_seed(0)
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


def flex_attention_fn(device: torch.device) -> FlexFn | None:
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


def dot(
    s: Shapes,
    *,
    dtype: torch.dtype,
    device: torch.device,
    flex: bool,
    backward: bool,
    with_textbook: bool = True,
) -> Built:
    """Scaled dot-product attention, (B, n, d) or with heads (B, H, n, d) when ``s`` has H:
    attnscore, SDPA + bool mask, flex_attention (``flex``), the book (3-D only)."""
    torch.manual_seed(0)
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
    fn = flex_attention_fn(device) if flex and (device.type == "cuda" or not backward) else None
    if fn is not None:

        def flex_forward() -> Tensor:
            mask = flex_block_mask(vl, n, m)
            if heads:
                return fn(q, k, v, mask)
            return fn(q[:, None], k[:, None], v[:, None], mask)[:, 0]

        forwards["flex"] = flex_forward
        notes.append("flex = flex_attention with a block mask built from the lengths per call")
    if with_textbook and not heads:
        book = textbook.DotProductAttention(0.0).eval()
        forwards["textbook"] = lambda: book(q, k, v, vl)
    return Built(
        forwards,
        grad_inputs={name: [q, k, v] for name in forwards},
        same=("sdpa", "flex", "textbook"),
        notes=notes,
    )


def additive(
    s: Shapes,
    *,
    backward: bool,
    device: torch.device,
    with_textbook: bool = True,
    compiled: bool = False,
) -> Built:
    """Additive attention: attnscore's (from the registry) and the book's module with the
    same parameters; the book's is left out where its (B, n, m, h) tensors would not fit.
    ``compiled``: both under ``torch.compile``."""
    torch.manual_seed(0)
    B, n, m, h, d = s["B"], s["n"], s["m"], s["h"], s["d"]
    q, k, v = (torch.randn(B, x, d, device=device) for x in (n, m, m))
    vl = lengths(B, m, device)
    ours = make_scorer("additive", query_size=d, key_size=d, num_hiddens=h).to(device).eval()
    modules: dict[str, nn.Module] = {"attnscore": ours}
    notes = []
    # The book keeps (B, n, m, h) features, their tanh and its gradient: about 3 tensors
    # of that size in fwd+bwd, 2 in the forward.
    features = B * n * m * h * 4
    need = (3 if backward else 2) * features
    free = free_bytes(device) if with_textbook else 0
    if need < 0.9 * free:
        book = textbook.AdditiveAttention(d, d, h, 0.0).to(device).eval()
        book.load_state_dict(ours.state_dict(), strict=True)  # the book's checkpoint layout
        modules["textbook"] = book
    else:
        why = f", about {need / 2**30:.1f} GiB in all, {free / 2**30:.1f} GiB free" if free else ""
        notes.append(
            f"textbook not run: its (B, n, m, h) float32 features tensor alone is "
            f"{features / 2**30:.1f} GiB{why}"
        )
    if compiled:
        modules = {name: torch.compile(mod) for name, mod in modules.items()}  # type: ignore[misc]
        notes.append("both modules under torch.compile (default mode); kernels on")

    def forward(mod: nn.Module) -> Forward:
        return lambda: mod(q, k, v, vl)

    return Built(
        {name: forward(mod) for name, mod in modules.items()},
        grad_inputs={name: list(mod.parameters()) for name, mod in modules.items()},
        same=("textbook",),
        notes=notes,
    )


def mha(s: Shapes, *, autocast: bool, device: torch.device) -> Built:
    """Multi-head self-attention (B, n, E), H heads: attnscore's ``MultiHeadAttention`` and
    ``nn.MultiheadAttention`` with the same weights; ``autocast``: under bf16 autocast."""
    torch.manual_seed(0)
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
