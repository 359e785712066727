"""The implementations each bench cell compares, built for the CPU and the CUDA runs alike.

Each builder makes its inputs from a fixed seed (valid lengths uniform in [1, m]) and
returns a :class:`~attnscore.bench._core.Built`: attnscore's implementation (scorers from
the registry) and the PyTorch call a user would write instead, on the same work (each
builder's docstring names it; additive, general and cosine, which PyTorch lacks, against
their plain formulation: the textbook's scores, ``masked_fill(-inf)``, softmax, ``@ V``).

Masks (the matrix's columns): ``none``; ``lengths (B,)`` and ``lengths (B, n)``, uniform in
[1, m]; ``bool``, a (B, n, m) mask letting each query attend a random half of the keys (key
0 always); ``causal``; ``causal + lengths`` (lengths (B,)); outside the matrix, ``cache
lengths (B,)``, uniform in [m/2, m] (a KV cache's filled lengths). Every mask is built inside
the timed call, on both sides, as a user's code builds it per batch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnscore

from .. import textbook
from ..modules import make_scorer
from ._core import Built, Forward, Shapes, lengths

MASKS = ("none", "lengths (B,)", "lengths (B, n)", "bool", "causal", "causal + lengths")
"""The matrix's mask columns."""

CACHE = "cache lengths (B,)"
"""Decoding's mask (outside the matrix): the lengths a KV cache holds, uniform in [m/2, m]."""

UNCUT = "lengths (B,) = m"
"""A batch with nothing padded (outside the matrix): key lengths, each m."""

SOFTMAX_MASKS = ("none", "lengths (B,)", "lengths (B, n)")
"""``masked_softmax(X, valid_lens)`` takes lengths only."""


class Masks:
    """The inputs of one mask column for a batch of B examples, n queries and m keys, from a
    fixed seed: attnscore's keyword arguments and, for baselines, the dense (B, n, m) form."""

    def __init__(self, kind: str, B: int, n: int, m: int, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(1)
        self.kind, self.n, self.m, self.device = kind, n, m, device
        self.valid_lens: Tensor | None = None
        self.attend: Tensor | None = None
        self.causal = kind.startswith("causal")
        if kind in ("lengths (B,)", "causal + lengths", CACHE):
            self.valid_lens = lengths(B, m, device, low=max(1, m // 2) if kind == CACHE else 1)
        elif kind == UNCUT:
            self.valid_lens = torch.full((B,), m, device=device)
        elif kind == "lengths (B, n)":
            self.valid_lens = torch.randint(1, m + 1, (B, n), generator=gen).to(device)
        elif kind == "bool":
            attend = torch.rand(B, n, m, generator=gen) < 0.5
            attend[..., 0] = True
            self.attend = attend.to(device)
        elif kind != "none" and kind != "causal":
            known = (*MASKS, CACHE, UNCUT)
            raise ValueError(f"Expected a mask among {known}, but got {kind!r} instead.")

    def kwargs(self) -> dict[str, Any]:
        """attnscore's mask arguments (``valid_lens`` positional as the textbook's)."""
        out: dict[str, Any] = {}
        if self.attend is not None:
            out["attend_mask"] = self.attend
        if self.causal:
            out["causal"] = True
        return out

    def dense(self) -> Tensor | None:
        """Bool (B, 1 or n, m), True = may attend, built as a user's code would (per call)."""
        allowed = self.attend
        device = self.device
        if self.valid_lens is not None:
            positions = torch.arange(self.m, device=device)
            valid_lens = self.valid_lens
            bound = valid_lens[..., None] if valid_lens.ndim > 1 else valid_lens[:, None, None]
            allowed = positions < bound
        if self.causal:
            tril = torch.ones(self.n, self.m, dtype=torch.bool, device=device).tril()
            allowed = tril if allowed is None else allowed & tril
        return allowed


def _sdpa(q: Tensor, k: Tensor, v: Tensor, masks: Masks) -> Tensor:
    """SDPA in 4-D layout: (B, n, d) gets a head dimension; the mask gets (B, 1, n|1, m)."""
    three_d = q.ndim == 3
    if three_d:
        q, k, v = q[:, None], k[:, None], v[:, None]
    causal = masks.kind == "causal"  # is_causal, as a user writes it; else the dense mask
    allowed = None if causal else masks.dense()
    mask = None if allowed is None else allowed.unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
    return out[:, 0] if three_d else out


def _plain_pool(scores: Tensor, v: Tensor, masks: Masks) -> Tensor:
    """The plain formulation after the (B, n, m) scores: masked_fill(-inf), softmax, @ V."""
    allowed = masks.dense()
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _inputs(
    shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: torch.device, grad: bool
) -> list[Tensor]:
    torch.manual_seed(0)
    return [torch.randn(*s, device=device).to(dtype).requires_grad_(grad) for s in shapes]


def softmax(
    s: Shapes, mask: str, *, dtype: torch.dtype, device: torch.device, backward: bool
) -> Built:
    """Masked softmax (B, n, m): attnscore, unmasked ``torch.softmax``, and (float32 forward
    with lengths) the textbook's ``masked_softmax``."""
    (X,) = _inputs([(s["B"], s["n"], s["m"])], dtype, device, backward)
    masks = Masks(mask, s["B"], s["n"], s["m"], device)
    valid_lens = masks.valid_lens
    forwards: dict[str, Forward] = {
        "attnscore": lambda: attnscore.masked_softmax(X, valid_lens),
        "softmax": lambda: torch.softmax(X, -1),
    }
    notes = []
    if valid_lens is not None and dtype == torch.float32 and not backward:
        X_book = X.detach().clone()  # the book's masked_softmax writes -1e6 into its input
        forwards["textbook"] = lambda: textbook.masked_softmax(X_book, valid_lens)
        notes.append("textbook = d2l.masked_softmax")
    return Built(forwards, {name: [X] for name in forwards}, same=("textbook",), notes=notes)


def dot(s: Shapes, mask: str, *, dtype: torch.dtype, device: torch.device, backward: bool) -> Built:
    """Scaled dot-product attention, (B, n, d) or with heads (B, H, n, d) when ``s`` has H:
    attnscore's ``DotProductAttention`` and SDPA with the equivalent mask."""
    B, n, m, d = s["B"], s["n"], s["m"], s["d"]
    heads = (s["H"],) if "H" in s else ()
    q, k, v = _inputs([(B, *heads, x, d) for x in (n, m, m)], dtype, device, backward)
    masks = Masks(mask, B, n, m, device)
    ours = make_scorer("scaled_dot", query_size=d)
    kwargs = masks.kwargs()
    if heads and masks.attend is not None:
        kwargs["attend_mask"] = masks.attend.unsqueeze(1)  # (B, 1, n, m): every head
    valid_lens = masks.valid_lens
    forwards: dict[str, Forward] = {
        "attnscore": lambda: ours(q, k, v, valid_lens, **kwargs),
        "sdpa": lambda: _sdpa(q, k, v, masks),
    }
    return Built(forwards, {name: [q, k, v] for name in forwards}, same=("sdpa",))


def multihead(
    s: Shapes, mask: str, *, dtype: torch.dtype, device: torch.device, backward: bool
) -> Built:
    """Multi-head self-attention (B, n, E), H heads (cross-attention to (B, m, E) where ``s``
    has m): attnscore's ``MultiHeadAttention`` and ``nn.MultiheadAttention`` with the same
    weights (no biases), ``need_weights=False``."""
    B, n, E, H, m = s["B"], s["n"], s["E"], s["H"], s.get("m", s["n"])
    x, *memory = _inputs([(B, n, E), *[(B, m, E)] * ("m" in s)], dtype, device, backward)
    kv = memory[0] if memory else x
    masks = Masks(mask, B, n, m, device)
    ours = attnscore.MultiHeadAttention(E, H).to(device)
    with torch.no_grad():
        ours(x.float(), kv.float(), kv.float())  # materialize
    ours = ours.to(dtype)
    theirs = nn.MultiheadAttention(E, H, bias=False, batch_first=True).to(device)
    with torch.no_grad():
        w = torch.cat([ours.W_q.weight, ours.W_k.weight, ours.W_v.weight])
        theirs.in_proj_weight.copy_(w.float())
        theirs.out_proj.weight.copy_(ours.W_o.weight.float())
    theirs = theirs.to(dtype)
    kwargs = masks.kwargs()
    valid_lens = masks.valid_lens

    def torch_mha() -> Tensor:
        padding, attn_mask = None, None
        if valid_lens is not None and valid_lens.ndim == 1:
            padding = torch.arange(m, device=device) >= valid_lens[:, None]  # True = ignore
        elif masks.kind in ("lengths (B, n)", "bool"):
            allowed = masks.dense()
            assert allowed is not None
            attn_mask = ~allowed.repeat_interleave(H, dim=0)  # (B * H, n, m), True = ignore
        if masks.causal:
            attn_mask = ~torch.ones(n, n, dtype=torch.bool, device=device).tril()
        out: Tensor
        out, _ = theirs(
            x,
            kv,
            kv,
            key_padding_mask=padding,
            attn_mask=attn_mask,
            need_weights=False,
            is_causal=masks.causal,
        )
        return out

    forwards: dict[str, Forward] = {
        "attnscore": lambda: ours(x, kv, kv, valid_lens, **kwargs),
        "torch_mha": torch_mha,
    }
    modules = {"attnscore": ours, "torch_mha": theirs}
    grads = {name: [x, *memory, *module.parameters()] for name, module in modules.items()}
    return Built(forwards, grads, same=("torch_mha",))


def _scorer_row(
    name: str,
    plain_scores: Callable[[Any, Tensor, Tensor], Tensor],
    s: Shapes,
    mask: str,
    *,
    dtype: torch.dtype,
    device: torch.device,
    backward: bool,
) -> Built:
    """attnscore's ``name`` module and the plain formulation (``plain_scores``, then
    :func:`_plain_pool`) with the same parameters."""
    B, n, m, d = s["B"], s["n"], s["m"], s["d"]
    q, k, v = _inputs([(B, n, d), (B, m, d), (B, m, d)], dtype, device, backward)
    masks = Masks(mask, B, n, m, device)
    torch.manual_seed(0)
    ours = make_scorer(name, query_size=d, key_size=d, num_hiddens=s.get("h", d)).to(device)
    ours = ours.to(dtype)
    kwargs = masks.kwargs()
    valid_lens = masks.valid_lens
    forwards: dict[str, Forward] = {
        "attnscore": lambda: ours(q, k, v, valid_lens, **kwargs),
        "plain": lambda: _plain_pool(plain_scores(ours, q, k), v, masks),
    }
    params = list(ours.parameters())
    return Built(forwards, {key: [q, k, v, *params] for key in forwards}, same=("plain",))


def _additive_scores(module: Any, q: Tensor, k: Tensor) -> Tensor:
    """The textbook's: features (B, n, m, h) = tanh(W_q q + W_k k), then w_v (the plain
    formulation holds (B, n, m, h) tensors)."""
    features = torch.tanh(module.W_q(q).unsqueeze(2) + module.W_k(k).unsqueeze(1))
    scores: Tensor = module.w_v(features).squeeze(-1)
    return scores


def _general_scores(module: Any, q: Tensor, k: Tensor) -> Tensor:
    W_a: Tensor = module.W_a.weight
    return (q @ W_a) @ k.transpose(1, 2)


def _cosine_scores(module: Any, q: Tensor, k: Tensor) -> Tensor:
    scale: Tensor = module.log_scale.exp()
    return scale * F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(1, 2)


BUILDERS: dict[str, Callable[..., Built]] = {
    "masked_softmax": softmax,
    "dot": dot,
    "heads": dot,
    "multihead": multihead,
    "additive": partial(_scorer_row, "additive", _additive_scores),
    "general": partial(_scorer_row, "general", _general_scores),
    "cosine": partial(_scorer_row, "cosine", _cosine_scores),
}
"""Row name -> builder ``(shapes, mask, *, dtype, device, backward) -> Built``."""


# ---- rows outside the matrix -----------------------------------------------------------


def decoder_step(s: Shapes, *, device: torch.device) -> Built:
    """One step of a seq2seq decoder: additive attention of B queries (n = 1) over the same
    m encoder outputs at every step, evaluation mode: attnscore vs the textbook module."""
    B, m, h = s["B"], s["m"], s["h"]
    q, keys = _inputs([(B, 1, h), (B, m, h)], torch.float32, device, False)
    valid_lens = lengths(B, m, device)
    ours = attnscore.AdditiveAttention(h, h, h).to(device).eval()
    book = textbook.AdditiveAttention(h, h, h, 0.0).to(device).eval()
    book.load_state_dict(ours.state_dict(), strict=True)
    return Built(
        {
            "attnscore": lambda: ours(q, keys, keys, valid_lens),
            "textbook": lambda: book(q, keys, keys, valid_lens),
        },
        same=("textbook",),
        notes=["decoder_step: the same keys tensor at every step, as a decoder's loop passes"],
    )


def _additive(s: Shapes, device: torch.device) -> tuple[list[Tensor], nn.Module]:
    """(queries, keys, values, valid_lens) and attnscore's additive module at ``s``."""
    B, n, m, h, d = s["B"], s["n"], s["m"], s["h"], s["d"]
    inputs = _inputs([(B, n, d), (B, m, d), (B, m, d)], torch.float32, device, False)
    ours = make_scorer("additive", query_size=d, key_size=d, num_hiddens=h).to(device)
    return [*inputs, lengths(B, m, device)], ours


def additive_memory(s: Shapes, *, device: torch.device) -> Built:
    """Additive attention fwd+bwd at a size where the textbook's (B, n, m, h) tensor alone
    takes several GiB: attnscore only (its peak RSS is the target)."""
    args, ours = _additive(s, device)
    nbytes = s["B"] * s["n"] * s["m"] * s["h"] * 4
    size = f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"
    return Built(
        {"attnscore": lambda: ours(*args)},
        {"attnscore": list(ours.parameters())},
        notes=[
            "additive_memory: attnscore's peak RSS alone (the textbook is not run); the "
            f"textbook's (B, n, m, h) float32 features tensor would take {size} here by itself"
        ],
    )


def compiled_additive(s: Shapes, *, device: torch.device) -> Built:
    """Additive attention fwd+bwd, attnscore's module and the textbook's (same parameters),
    both under ``torch.compile``: the registered kernel ops stay in the compiled graph."""
    args, ours = _additive(s, device)
    book = textbook.AdditiveAttention(s["d"], s["d"], s["h"], 0.0).to(device)
    book.load_state_dict(ours.state_dict(), strict=True)
    ours_compiled, book_compiled = torch.compile(ours), torch.compile(book)
    return Built(
        {"attnscore": lambda: ours_compiled(*args), "textbook": lambda: book_compiled(*args)},
        {"attnscore": list(ours.parameters()), "textbook": list(book.parameters())},
        same=("textbook",),
        notes=["additive_compiled: both modules under torch.compile (default mode)"],
    )


def compiled_softmax(s: Shapes, *, device: torch.device) -> Built:
    """``torch.compile(attnscore.masked_softmax)`` against the same function uncompiled."""
    (X,) = _inputs([(s["B"], s["n"], s["m"])], torch.float32, device, False)
    valid_lens = lengths(s["B"], s["m"], device)
    compiled = torch.compile(attnscore.masked_softmax)
    return Built(
        {
            "attnscore": lambda: compiled(X, valid_lens),
            "eager": lambda: attnscore.masked_softmax(X, valid_lens),
        },
        same=("eager",),
        notes=["masked_softmax_compiled: attnscore = torch.compile(masked_softmax), eager = not"],
    )
