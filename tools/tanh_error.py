"""How far the additive kernels' two tanh are from float64 (issue 17), measured on the CPU.

* **exact** (the exp-based formula of ``_triton_additive._tanh``): the real kernel, run
  under Triton's interpreter (``TRITON_INTERPRET=1``: NumPy float32 arithmetic; on a GPU
  ``tl.exp`` is ``ex2.approx`` instead, a few ulp).
* **approx** (``tanh.approx.f32``): the interpreter cannot run PTX, so it is emulated:
  every tanh value is multiplied by (1 + delta) with |delta| at most a bound, then the
  sum over h is taken in float64 and rounded to the output dtype. Two bounds: 2^-11,
  the maximum relative error the PTX ISA guarantees, and 1.1126e-5 (2^-16.46), the maximum
  relative error reported for the instruction on hardware (N. Juffa, NVIDIA developer
  forums, "Hardware-accelerated tanh() on Turing", 2021). Two choices of delta: the worst
  case (its sign that of w_v[h] tanh, so that every error adds up) and uniform random
  values.

Inputs are shaped like the benchmark's additive attention: qh, kh ~ N(0, 1), w_v ~
U(-1/sqrt(h), 1/sqrt(h)) (``nn.Linear``'s initialisation), all keys valid; errors are
``max |scores - reference| / max |reference|`` with the float64 textbook formula on the
same (rounded) inputs as reference. ``TRITON_INTERPRET=1 python tools/tanh_error.py``
prints the Markdown table of docs/benchmarks.md (the variable must be set before Python
starts: importing attnscore imports torch's compiler stack, which imports triton, which
decides then whether it interprets).

A developer tool, not part of the package (the wheel leaves tools/ out);
``tests/kernels/test_cuda_backend.py`` checks its table in every test run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

#: Maximum relative error of tanh.approx.f32 in the PTX ISA.
PTX_BOUND = 2.0**-11
#: Maximum relative error measured on hardware (see the module docstring).
HARDWARE_BOUND = 1.1126e-5
BOUNDS = ((PTX_BOUND, "PTX ISA bound"), (HARDWARE_BOUND, "hardware bound"))

Kernel = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass(frozen=True)
class Row:
    """One line of the table: a tanh, an input/output dtype and the error it gives."""

    tanh: str  # "exact" or "approx"
    dtype: str
    how: str  # how the number was obtained
    tanh_error: float  # max relative error of tanh itself
    score_error: float  # max |scores - reference| / max |reference|


def inputs(B: int, n: int, m: int, h: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """float64 (qh (B, n, h), kh (B, m, h), w_v (h,), lengths (B, n) all m)."""
    gen = torch.Generator().manual_seed(seed)
    qh = torch.randn(B, n, h, generator=gen, dtype=torch.float64)
    kh = torch.randn(B, m, h, generator=gen, dtype=torch.float64)
    w_v = (torch.rand(h, generator=gen, dtype=torch.float64) * 2 - 1) / math.sqrt(h)
    return qh, kh, w_v, torch.full((B, n), m, dtype=torch.int64)


def _features(qh: Tensor, kh: Tensor) -> Tensor:
    return torch.tanh(qh[:, :, None, :] + kh[:, None, :, :])  # (B, n, m, h) float64


def _relative(ours: Tensor, ref: Tensor) -> float:
    return float((ours.double() - ref).abs().max() / ref.abs().max())


def emulated_scores(
    qh: Tensor, kh: Tensor, w_v: Tensor, bound: float, *, worst: bool, dtype: torch.dtype,
    gen: torch.Generator | None = None,
) -> Tensor:  # fmt: skip
    """Scores with every tanh off by a relative ``bound`` (worst-case signs, or uniform
    random in [-bound, bound]), summed in float64 and rounded to ``dtype``; inputs are
    the float64 values (round them to the dtype first to model 16-bit inputs)."""
    t = _features(qh, kh)
    if worst:
        delta = bound * torch.sign(t * w_v)
    else:
        delta = (torch.rand(t.shape, generator=gen, dtype=torch.float64) * 2 - 1) * bound
    return ((t * (1 + delta)) @ w_v).to(dtype)


def _tanh_grid() -> Tensor:
    """x from 1e-6 to 20 in magnitude, both signs."""
    x = torch.logspace(-6, math.log10(20.0), 4001, dtype=torch.float64)
    return torch.cat([-x, x])


def _tanh_itself(kernel: Kernel) -> float:
    """Max relative error of the kernel's tanh over :func:`_tanh_grid`: scores of one
    query with qh = 0 against keys kh = x, h = 1, w_v = 1 are tanh(x)."""
    x = _tanh_grid().float()
    t = kernel(
        torch.zeros(1, 1, 1),
        x[None, :, None],
        torch.ones(1),
        torch.full((1, 1), x.numel(), dtype=torch.int64),
    )[0, 0].double()
    want = torch.tanh(x.double())
    return float(((t - want) / want).abs().max())


def table(kernel: Kernel | None, shape: Sequence[int] = (2, 32, 64, 128)) -> list[Row]:
    """The rows of the table; ``kernel`` computes float32 scores with the exact tanh
    (None leaves that row out)."""
    qh, kh, w_v, lengths = inputs(*shape)
    rows = []
    if kernel is not None:
        q32, k32, w32 = qh.float(), kh.float(), w_v.float()
        ref32 = _features(q32.double(), k32.double()) @ w32.double()
        ours = kernel(q32, k32, w32, lengths)
        how = "the kernel under the interpreter"
        rows.append(Row("exact", "float32", how, _tanh_itself(kernel), _relative(ours, ref32)))
    ref = _features(qh, kh) @ w_v
    gen = torch.Generator().manual_seed(1)
    for bound, name in BOUNDS:
        for worst in (True, False):
            scores = emulated_scores(qh, kh, w_v, bound, worst=worst, dtype=torch.float32, gen=gen)
            how = f"emulated: {name}, {'worst-case' if worst else 'random'} signs"
            rows.append(Row("approx", "float32", how, bound, _relative(scores, ref)))
    for dtype in (torch.bfloat16, torch.float16):
        q16, k16, w16 = (t.to(dtype).double() for t in (qh, kh, w_v))
        ref16 = _features(q16, k16) @ w16
        name = str(dtype).removeprefix("torch.")
        exact = ref16.to(dtype)  # the exact sum, rounded to the output dtype
        rows.append(Row("exact", name, "float64 sum rounded to the dtype", 0.0,
                        _relative(exact, ref16)))  # fmt: skip
        for bound, bound_name in BOUNDS:
            off = emulated_scores(q16, k16, w16, bound, worst=True, dtype=dtype)
            how = f"emulated: {bound_name}, worst-case signs"
            rows.append(Row("approx", name, how, bound, _relative(off, ref16)))
    return rows


def markdown(rows: Sequence[Row], shape: Sequence[int]) -> str:
    """The rows as a Markdown table."""
    B, n, m, h = shape
    lines = [
        f"B={B} n={n} m={m} h={h}; qh, kh ~ N(0, 1), w_v ~ U(-1/sqrt(h), 1/sqrt(h)).",
        "",
        "| tanh | dtype | how | max relative error of tanh | max score error / max score |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        tanh = "-" if r.tanh_error == 0 else f"{r.tanh_error:.2e}"
        lines.append(f"| {r.tanh} | {r.dtype} | {r.how} | {tanh} | {r.score_error:.2e} |")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    """``TRITON_INTERPRET=1 python tools/tanh_error.py``: print the table (exit 2 when the
    variable was not set)."""
    parser = argparse.ArgumentParser(prog="python tools/tanh_error.py")
    parser.add_argument("--shape", type=int, nargs=4, default=[2, 32, 64, 128],
                        metavar=("B", "n", "m", "h"))  # fmt: skip
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        print("run as TRITON_INTERPRET=1 python tools/tanh_error.py", file=sys.stderr)
        return 2
    from attnscore.kernels import _triton_additive

    def kernel(qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
        return _triton_additive.additive_fwd(qh, kh, w_v, lengths, approx=False)

    print(markdown(table(kernel, args.shape), args.shape), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
