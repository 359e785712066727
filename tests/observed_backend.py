"""A backend that observes: the CPU backend's contract functions, each call reported, put in
with the public ``attnscore.kernels.use_backend`` (tests see which implementation ran
without patching the backend module's names)."""

from __future__ import annotations

import contextlib
import types
from collections.abc import Callable, Iterator
from typing import Any

from attnscore import kernels
from attnscore.kernels import _cpu
from attnscore.kernels._dispatch import FUNCTIONS


@contextlib.contextmanager
def observed_cpu(on_call: Callable[[str, tuple[Any, ...], Any], None]) -> Iterator[None]:
    """Inside the body, every call the dispatch makes to a CPU backend function runs the
    real one and then ``on_call(name, positional arguments, result)`` (calls the backend
    makes to its own functions are not dispatched and not reported)."""
    module = types.ModuleType(_cpu.__name__)  # backend_name() still names the CPU backend
    for name in FUNCTIONS:
        setattr(module, name, _observed(name, getattr(_cpu, name), on_call))
    with kernels.use_backend("cpu", module):
        yield


def _observed(
    name: str, real: Callable[..., Any], on_call: Callable[[str, tuple[Any, ...], Any], None]
) -> Callable[..., Any]:
    def observed(*args: Any, **kwargs: Any) -> Any:
        out = real(*args, **kwargs)
        on_call(name, args, out)
        return out

    return observed
