"""The CUDA rows of issue 10: attnscore against the textbook code, SDPA, flex_attention and
``nn.MultiheadAttention``, fp32 and bf16, with peak CUDA memory.

:func:`cases` takes the device and a shape scale, so the same case list runs on the CPU
at tiny shapes in the tests (``cases(torch.device("cpu"), scale=1/64)``); only
``attnscore bench --device cuda`` runs it at full size.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from . import _cases
from ._cases import ADDITIVE_LARGE, ADDITIVE_SMALL, DOT, HEADS, MHA, SOFTMAX
from ._core import Built, Case, Shapes, Target, device_name, scaled

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}

KEEP = ("d", "H", "E")
"""Sizes a shape scale leaves alone (feature and head sizes)."""


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
            partial(_cases.softmax, dtype=DTYPES[dt], device=device),
            [Target("time", 0.8, "softmax")],
        )
    for backward in (False, True):
        for dt in DTYPES:
            add(
                "dot_fwd_bwd" if backward else "dot_fwd",
                DOT,
                dt,
                partial(_cases.dot, dtype=DTYPES[dt], device=device, flex=flex, backward=backward),
                [Target("time", 1.0, "sdpa"), Target("peak", 2.0, "sdpa")],
                backward,
            )
    add(
        "dot_heads_fwd",
        HEADS,
        "bfloat16",
        partial(_cases.dot, dtype=torch.bfloat16, device=device, flex=flex, backward=False),
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
                partial(_cases.additive, backward=backward, device=device),
                targets,
                backward,
            )
    for dt, autocast in (("float32", False), ("bf16 autocast", True)):
        add(
            "multihead_fwd_bwd",
            MHA,
            dt,
            partial(_cases.mha, autocast=autocast, device=device),
            [Target("time", 1.1, "torch_mha")],
            True,
        )
    return out


def describe(device: torch.device) -> str:
    """One line naming the GPU (or CPU), torch and CUDA versions."""
    cuda = torch.version.cuda
    return f"{device_name(device)}, torch {torch.__version__}" + (f", CUDA {cuda}" if cuda else "")
