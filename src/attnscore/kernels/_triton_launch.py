"""One kernel launch as data, shared by the Triton launchers and the compile report.

The launchers of :mod:`._triton_softmax` and :mod:`._triton_additive` describe each launch
as a :class:`Launch` (kernel, arguments, meta-parameters, grid) and run it; the
ahead-of-time report (``tools/triton_aot.py``, outside the package) builds the same
launches from ``meta`` tensors and compiles them without a GPU, so what it checks is what
would run.

Autotuned kernels (a ``triton.autotune`` wrapper) carry their candidate configurations after
pruning: on CUDA the autotuner times them and keeps the fastest; under ``TRITON_INTERPRET=1``
timing means nothing, so the first candidate runs.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Programs a launch at the benchmark shapes must have: 2 per SM of an H100 (132 SMs).
MIN_PROGRAMS = 264


def hardware_tanh(*dtypes: Any, mode: str) -> bool:
    """Whether additive kernels on CUDA inputs of these torch dtypes use the hardware
    ``tanh.approx.f32`` in tanh ``mode`` (``"auto"``: only when every input is float16 or
    bfloat16; ``"exact"``: never; ``"approx"``: always); never with float64."""
    names = {str(dt) for dt in dtypes}
    if mode == "exact" or "torch.float64" in names:
        return False
    return mode == "approx" or names <= {"torch.float16", "torch.bfloat16"}


def interpreting() -> bool:
    """Whether Triton kernels run under its interpreter (``TRITON_INTERPRET`` set, not 0)."""
    return os.environ.get("TRITON_INTERPRET", "") not in ("", "0")


@dataclass(frozen=True)
class Launch:
    """One launch: ``kernel[grid(meta)](*args, **meta)``.

    Attributes:
        kernel: a ``@triton.jit`` function, or a ``triton.autotune`` wrapper of one.
        args: the positional arguments (tensors and ints), as the kernel receives them.
        meta: constexpr arguments and launch options (``num_warps``) fixed by the launcher.
        grid: the grid from the full meta-parameters (``meta`` plus a configuration's).
        configs: for an autotuned kernel, the meta-parameters of each candidate
            configuration that survives pruning (at least one); empty otherwise.
    """

    kernel: Any
    args: tuple[Any, ...]
    meta: dict[str, Any]
    grid: Callable[[dict[str, Any]], tuple[int, ...]]
    configs: tuple[dict[str, Any], ...] = field(default=())

    @property
    def name(self) -> str:
        """The kernel's Python name (``_fwd_kernel``, ...)."""
        fn = self.kernel
        while not hasattr(fn, "__name__"):
            fn = fn.fn
        return str(fn.__name__)

    def variants(self) -> list[dict[str, Any]]:
        """The full meta-parameters of every kernel this launch may run: one, or one per
        candidate configuration of an autotuned kernel."""
        return [{**self.meta, **c} for c in self.configs] or [dict(self.meta)]

    def run(self) -> None:
        """Launch the kernel (the autotuner picks among ``configs`` on CUDA)."""
        if self.configs and not interpreting():
            self.kernel[lambda meta: self.grid(meta)](*self.args, **self.meta)
            return
        meta = self.variants()[0]
        fn = self.kernel.fn if self.configs else self.kernel
        fn[self.grid(meta)](*self.args, **meta)


def config_meta(config: Any) -> dict[str, Any]:
    """A ``triton.Config``'s meta-parameters and launch options as one dict."""
    return dict(config.all_kwargs())
