"""The bench's cells: the matrix of real use, the rows of issue 16's table, and the rows that
check the kernels' other promises (memory, compiled code).

The matrix: rows {masked_softmax, dot (B, n, d), heads (B, H, n, d), multihead, additive,
general, cosine} x masks (:data:`attnscore.bench._cases.MASKS`; masked_softmax: lengths
only) x dtypes x steps {eval forward, forward + backward}, each cell with the targets of
:func:`targets`. ``--quick`` runs the same cells at small shapes, CUDA at larger ones
(:data:`SHAPES`).
"""

from __future__ import annotations

from functools import partial
from itertools import product

import torch

from . import _cases, _hf
from ._core import Case, Shapes, Target

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LENGTH_MASKS = ("lengths (B,)", "lengths (B, n)", "causal + lengths")

_SIZES = {
    # row: (its dimensions, then their sizes on the CPU, in a quick run, on CUDA)
    "masked_softmax": ("B n m", (32, 256, 1024), (8, 32, 128), (64, 256, 1024)),
    "dot": ("B n m d", (8, 512, 512, 64), (4, 64, 64, 32), (32, 1024, 1024, 64)),
    "heads": ("B H n m d", (4, 8, 256, 256, 64), (2, 4, 64, 64, 32), (16, 16, 1024, 1024, 64)),
    "multihead": ("B n E H", (8, 256, 256, 4), (4, 32, 64, 4), (32, 512, 512, 8)),
    "additive": ("B n m h d", (4, 128, 256, 128, 64), (2, 16, 64, 32, 16), (8, 128, 512, 128, 64)),
    "general": ("B n m d", (8, 256, 256, 64), (4, 64, 64, 32), (32, 1024, 1024, 64)),
    "cosine": ("B n m d", (8, 256, 256, 64), (4, 64, 64, 32), (32, 1024, 1024, 64)),
}
SHAPES: dict[str, dict[str, Shapes]] = {
    device: {
        row: dict(zip(dims.split(), sizes[i], strict=True))
        for row, (dims, *sizes) in _SIZES.items()
    }
    for i, device in enumerate(("cpu", "quick", "cuda"))
}
"""The matrix's shapes by device (``cpu``, ``cuda``) or ``quick``, then by row."""

BASELINE = {
    "masked_softmax": "softmax",
    "dot": "sdpa",
    "heads": "sdpa",
    "multihead": "torch_mha",
    "additive": "plain",
    "general": "plain",
    "cosine": "plain",
}
"""Each row's PyTorch baseline (an implementation name in its Built)."""


def targets(row: str, mask: str, dtype: str, backward: bool) -> list[Target]:
    """A cell's targets (issue 16): <= 1.05x its baseline in time and peak memory, and

    - masked_softmax with lengths: <= 1.0x ``torch.softmax`` (16-bit included); float32
      forward with lengths (B,): <= 0.25x the textbook's;
    - dot / heads with lengths (uniform in [1, m]): forward <= 0.8x, forward + backward
      <= 0.9x SDPA with the mask;
    - multihead with lengths: forward + backward <= 0.9x ``nn.MultiheadAttention``;
    - additive forward + backward, float32, with lengths: <= 0.1x the plain (textbook)
      formulation, >= 10x faster (the target of the row this replaces, at its masks);
    - general and cosine with a mask: <= 1.0x the plain formulation (without one they run
      its very operations: the rule's 1.05x, a tie within the measurement's noise).
    """
    base = BASELINE[row]
    bound = 1.05
    if row == "masked_softmax" and mask != "none":
        bound = 1.0
    elif row in ("dot", "heads") and mask in LENGTH_MASKS:
        bound = 0.9 if backward else 0.8
    elif row == "multihead" and mask in LENGTH_MASKS and backward:
        bound = 0.9
    elif row == "additive" and backward and dtype == "float32" and mask in LENGTH_MASKS:
        bound = 0.1
    elif row in ("general", "cosine") and mask != "none":
        bound = 1.0
    out = [Target("time", bound, base), Target("peak", 1.05, base)]
    if row == "masked_softmax" and mask == "lengths (B,)" and dtype == "float32" and not backward:
        out.append(Target("time", 0.25, "textbook"))
    return out


def _cell(
    row: str,
    s: Shapes,
    mask: str,
    dtype: str,
    device: torch.device,
    backward: bool,
    tgts: list[Target],
    name: str | None = None,
) -> Case:
    """The case of a row of :data:`_cases.BUILDERS` (named ``name``, default ``row``)."""
    build = partial(
        _cases.BUILDERS[row], s, mask, dtype=DTYPES[dtype], device=device, backward=backward
    )
    return Case(name or row, s, dtype, build, tgts, backward=backward, mask=mask)


def matrix(device_type: str, quick: bool) -> list[Case]:
    """The matrix's cells for a device type (``cpu`` or ``cuda``), at full or smoke shapes."""
    device = torch.device(device_type)
    return [
        _cell(row, s, mask, dtype, device, backward, targets(row, mask, dtype, backward))
        for row, s in SHAPES["quick" if quick else device_type].items()
        for mask in (_cases.SOFTMAX_MASKS if row == "masked_softmax" else _cases.MASKS)
        for dtype in DTYPES
        for backward in (False, True)
    ]


# ---- rows outside the matrix -----------------------------------------------------------

_LARGE_DOT: Shapes = {"B": 32, "n": 1024, "m": 1024, "d": 64}
_LARGE_SOFTMAX: Shapes = {"B": 64, "n": 256, "m": 1024}
_LENGTHS = "lengths (B,)"

LARGE_ROWS: list[tuple[str, str, Shapes, str, bool, list[Target]]] = [
    # (row, mask, shapes, dtype, backward, targets): the calls of issue 16's report
    # (the first numbers users sent), at their shapes
    ("multihead", _LENGTHS, {"B": 32, "n": 512, "E": 512, "H": 8}, "float32", True,
     [Target("time", 0.9, "torch_mha")]),
    ("heads", _LENGTHS, {"B": 16, "H": 8, "n": 512, "m": 512, "d": 64}, "float32", True,
     [Target("time", 0.9, "sdpa")]),
    ("dot", "none", _LARGE_DOT, "float32", False, [Target("time", 1.05, "sdpa")]),
    ("dot", "causal", _LARGE_DOT, "float32", False, [Target("time", 1.05, "sdpa")]),
    ("dot", _LENGTHS, _LARGE_DOT, "float32", False, [Target("time", 0.8, "sdpa")]),
    ("dot", _LENGTHS, _LARGE_DOT, "float32", True, [Target("time", 0.9, "sdpa")]),
    ("masked_softmax", _LENGTHS, _LARGE_SOFTMAX, "bfloat16", False,
     [Target("time", 1.0, "softmax")]),
    ("masked_softmax", _LENGTHS, _LARGE_SOFTMAX, "float16", False,
     [Target("time", 1.0, "softmax")]),
    ("masked_softmax", _LENGTHS, {"B": 2, "n": 4, "m": 8}, "float32", False,
     [Target("us", 20.0), Target("time", 4.0, "softmax")]),
]  # fmt: skip
"""Large calls at their own shapes, from issue 16's report (float32 unless said; named
``ROW (large)``), and one tiny softmax call (``masked_softmax (tiny)``) with its own
targets: <= 20 us and <= 4x ``torch.softmax``."""

TINY: Shapes = {"B": 2, "n": 4, "m": 8, "d": 8, "H": 2, "E": 16, "h": 8}
"""Tiny calls (per-call overhead) of every attention row, lengths (B,), forward."""

MID: Shapes = {"B": 2, "n": 64, "m": 64, "d": 32, "H": 2, "E": 64, "h": 32}
"""Mid-size calls (small-batch inference: where the layers' per-call cost competes with the
work) of the dot-product-like rows, without a mask, by lengths (B,) and causal, forward."""
MID_MASKS = ("none", "lengths (B,)", "causal")

_DECODE = [{"B": B, "H": H, "n": 1, "m": m, "d": d} for m, H, d in ((512, 8, 64), (4096, 32, 128))
           for B in (1, 8)]  # fmt: skip
_DECODE_QUICK = [{"B": B, "H": 4, "n": 1, "m": 128, "d": 32} for B in (1, 4)]
_CROSS = [{"B": 1, "n": 1, "m": 50, "E": 256, "H": 8}]
_SERVING = [{"B": 8, "H": 12, "n": 128, "m": 128, "d": 64}]
_F32_BF16 = ("float32", "bfloat16")

USE = [
    # (name, builder row, shapes, shapes of --quick (none: skipped), masks, dtypes, backward)
    ("decode", "heads", _DECODE, _DECODE_QUICK, (_cases.CACHE, "none"), _F32_BF16, (False,)),
    ("decode_multihead", "multihead", _CROSS, _CROSS, (_cases.CACHE, "none"), _F32_BF16, (False,)),
    ("long_causal", "heads", [{"B": 1, "H": 8, "n": 4096, "m": 4096, "d": 128}], [], ("causal",),
     _F32_BF16, (False, True)),
    ("serving", "heads", _SERVING, _SERVING, (_LENGTHS, _cases.UNCUT), ("bfloat16",), (False,)),
]  # fmt: skip
"""What users run: a decoding step against a KV cache (n = 1, the cache's lengths or none;
``decode_multihead``: cross-attention to 50 encoder outputs), long causal attention (skipped
by ``--quick``), a small model serving padded batches, and batches that happen to hold no
padding (every length m). Targets: <= 1.0x the baseline in time with lengths, 1.05x
without, 1.05x in peak memory."""

DECODER: Shapes = {"B": 128, "m": 20, "h": 256}
ADDITIVE_MEMORY: Shapes = {"B": 4, "n": 1024, "m": 1024, "h": 256, "d": 64}
ADDITIVE_MEMORY_QUICK: Shapes = {"B": 1, "n": 256, "m": 256, "h": 64, "d": 16}
ADDITIVE_COMPILED: Shapes = {"B": 8, "n": 128, "m": 512, "h": 128, "d": 64}
SOFTMAX_COMPILED: Shapes = {"B": 64, "n": 256, "m": 1024}


def _tiny_shapes(row: str, sizes: Shapes = TINY) -> Shapes:
    return {k: sizes[k] for k in SHAPES["quick"][row]}


def extras(device_type: str, quick: bool) -> list[Case]:
    """The rows outside the matrix: large calls at their shapes, tiny and mid-size calls, what
    users run (:data:`USE`), the decoder step, a tiny Hugging Face Llama trained with
    ``"attnscore"`` against ``"sdpa"`` (issue 18; no verdict without transformers), and (CPU,
    full run) additive attention's peak RSS and the compiled rows."""
    device = torch.device(device_type)
    out: list[Case] = []
    if not quick:
        for row, mask, s, dtype, backward, tgts in LARGE_ROWS:
            size = "tiny" if s.get("m", 1024) <= 8 else "large"
            out.append(_cell(row, s, mask, dtype, device, backward, tgts, f"{row} ({size})"))
    rows = [row for row in BASELINE if row != "masked_softmax"]
    calls = [(row, TINY, _LENGTHS, "tiny") for row in rows]
    calls += [(row, MID, mask, "mid") for row in rows if row != "additive" for mask in MID_MASKS]
    for row, sizes, mask, size in calls:
        tgts, s = [Target("time", 1.05, BASELINE[row])], _tiny_shapes(row, sizes)
        out.append(_cell(row, s, mask, "float32", device, False, tgts, f"{row} ({size})"))
    for name, row, full, small, masks, dtypes, steps in USE:
        for s, mask, dtype, backward in product(small if quick else full, masks, dtypes, steps):
            bound = 1.0 if "lengths" in mask else 1.05
            tgts = [Target("time", bound, BASELINE[row]), Target("peak", 1.05, BASELINE[row])]
            out.append(_cell(row, s, mask, dtype, device, backward, tgts, name))
    step = partial(_cases.decoder_step, DECODER, device=device)
    faster = [Target("time", 1 / 1.5, "textbook")]
    out.append(Case("decoder_step", DECODER, "float32", step, faster, mask=_LENGTHS))
    hf = _hf.LLAMA_QUICK if quick else _hf.LLAMA
    tgts = [Target("time", 1.05, "sdpa"), Target("peak", 1.05, "sdpa")]
    llama = partial(_hf.llama, hf, device=device)
    out.append(Case("hf_llama", hf, "float32", llama, tgts, backward=True, mask="padded"))
    if device_type == "cpu":
        s = ADDITIVE_MEMORY_QUICK if quick else ADDITIVE_MEMORY
        build = partial(_cases.additive_memory, s, device=device)
        rss = [Target("rss_mib", 1024.0)]  # one fwd+bwd step's peak RSS (backward, not timed)
        out.append(Case("additive_memory", s, "float32", build, rss, True, False, _LENGTHS))
    if device_type == "cpu" and not quick:
        compiled = (  # (row, shapes, builder, bound, baseline); the additive one is fwd+bwd
            ("additive_compiled", ADDITIVE_COMPILED, _cases.compiled_additive, 0.1, "textbook"),
            ("masked_softmax_compiled", SOFTMAX_COMPILED, _cases.compiled_softmax, 1.3, "eager"),
        )
        for row, s, builder, bound, vs in compiled:
            build = partial(builder, s, device=device)
            target = [Target("time", bound, vs)]
            backward = row == "additive_compiled"
            out.append(Case(row, s, "float32", build, target, backward=backward, mask=_LENGTHS))
    return out


def cases(device_type: str, quick: bool) -> list[Case]:
    """Every cell of a run: the matrix, then the extra rows."""
    return matrix(device_type, quick) + extras(device_type, quick)
