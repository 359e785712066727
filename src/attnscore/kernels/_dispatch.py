"""The backend table: which module implements an op on which device type.

A *backend* is a module with the functions of :class:`Backend` (the backend contract).
Tensors arrive contiguous and on the backend's device; ``lengths`` is int64 on the same
device with values in [0, m]. A backend may leave a function out: that op then runs the
plain backend (:mod:`attnscore.kernels._plain`) on its device. Adding a backend is one
module plus one row in :data:`BACKENDS`. Dot-product attention is not a backend function:
its implementations are chosen by :mod:`attnscore.kernels._select`.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Final, Literal, Protocol, runtime_checkable

import torch
from torch import Tensor

from . import _plain

# device type -> the module implementing the backend contract there, imported on first use.
# Device types without a row (mps, xpu, meta, ...) run the plain backend.
BACKENDS: dict[str, str] = {
    "cpu": "attnscore.kernels._cpu",  # C kernels (ctypes) + padding-free flash SDPA
    # ---- GPU row: kernels/_cuda.py (Triton); ImportError (module or triton missing) -> plain
    "cuda": "attnscore.kernels._cuda",
}


Projection = Callable[[Tensor, Tensor], tuple[Tensor, Tensor]]
"""(queries, keys) -> (q, k) whose dot products are a scorer's scores."""

AdditiveProjection = Callable[[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]
"""(queries, keys) -> (W_q q [+ b], W_k k, w_v) of additive attention."""

NothingCut = Literal["nothing cut"]
"""The type of :data:`NOTHING_CUT`."""

NOTHING_CUT: Final[NothingCut] = "nothing cut"
"""What a small path returns (:meth:`Backend.small_dot_product_attention`) for a call it
would take but for its lengths, which cut no key: the caller runs it as a call with
nothing padded (it read the lengths: the caller need not)."""


@runtime_checkable
class Backend(Protocol):
    """The backend contract: what a device's kernels module provides (every function is
    optional at run time; the plain backend provides each one).

    Shapes: B batch, H heads, n queries, m keys, h hidden units, d query/key size, dv value
    size. Results are in the input's dtype, with exact zeros beyond each length and for
    length 0; positions beyond a length are never read; 16-bit inputs are reduced in
    float32.
    """

    def masked_softmax(self, x: Tensor, lengths: Tensor) -> Tensor:
        """x (..., m), lengths x.shape[:-1] -> softmax of x[..., :L], then exact zeros."""

    def masked_softmax_backward(self, grad_y: Tensor, y: Tensor, lengths: Tensor) -> Tensor:
        """y * (grad_y - sum_j grad_y y) over j < L; exact zeros beyond L and for L == 0.
        ``grad_y`` comes as autograd hands it: any strides (a sum's gradient is one value
        broadcast to y's shape)."""

    def softmax_pays(self, x: Tensor, training: bool) -> bool:
        """Whether this backend's :meth:`masked_softmax` with every length m measured
        faster than ``torch.softmax`` over the last axis of inputs like x (..., m) (in
        ``training``: as the forward of a step whose backward is PyTorch's softmax
        backward); the caller then runs it instead, else PyTorch's. Decided from the shape
        and dtype alone."""

    def small_masked_softmax(self, x: Tensor, valid_lens: Tensor) -> Tensor | None:
        """A small call without gradients, x (B, ..., n, m), int64 ``valid_lens`` as the
        caller got them (unchecked): the masked softmax in one step where the backend runs
        such calls whole and the lengths fit ((B,) or x.shape[:-1], on x's device, none
        negative); None otherwise (the caller then checks the lengths and calls
        masked_softmax)."""

    def masked_softmax_dense(self, x: Tensor, allowed: Tensor) -> Tensor:
        """x (..., m), allowed bool broadcastable to x -> softmax over the allowed positions,
        exact zeros elsewhere and on rows that allow nothing (backward: masked_softmax's
        with every length m)."""

    def mask_summary(
        self, allowed: Tensor, dtype: torch.dtype | None
    ) -> tuple[Tensor | None, Tensor, Tensor]:
        """allowed bool (..., r, m) -> (its additive form in ``dtype``: 0 where allowed,
        -inf elsewhere, or None for ``dtype`` None; rows that allow some key (..., r); keys
        some row allows (..., m))."""

    def lengths_mask(self, lengths: Tensor, m: int, dtype: torch.dtype) -> Tensor:
        """lengths (...) int64 -> (..., m) in ``dtype``: 0 at keys j < lengths[...], -inf
        beyond (the additive mask SDPA takes)."""

    def additive_scores(self, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor) -> Tensor:
        """qh (B, n, h), kh (B, m, h), w_v (h,), lengths (B, n) -> scores (B, n, m):
        sum_h w_v[h] tanh(qh[b, i, h] + kh[b, j, h]) for j < lengths[b, i], else 0."""

    def additive_scores_backward(
        self, grad_scores: Tensor, qh: Tensor, kh: Tensor, w_v: Tensor, lengths: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Gradients (qh, kh, w_v) of :meth:`additive_scores`."""

    def small_dot_product_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        valid_lens: Tensor,
        scale: float,
        project: Projection | None,
    ) -> tuple[Tensor, Tensor | None] | NothingCut | None:
        """An inference call small enough for one thread, q (B, n, d) or (B, H, n, d), k, v
        alike, int64 ``valid_lens`` as the caller got them (unchecked): (output, the weights
        (..., n, m) where the backend wrote them, else None) where the backend runs such
        calls whole and everything fits (one dtype, lengths (B,) or q.shape[:-1], none
        negative, some key cut); :data:`NOTHING_CUT` where all that holds but no length
        cuts a key; None otherwise (the caller then checks and takes the general path).
        ``project``, when given, maps (q, k) to the vectors whose dot products are the
        scores (general: q W_a; cosine: unit vectors), applied only once the call is
        taken: q may then differ from k in size."""

    def small_additive_attention(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        valid_lens: Tensor,
        hidden: int,
        project: AdditiveProjection,
    ) -> tuple[Tensor, Tensor] | None:
        """Additive attention's :meth:`small_dot_product_attention`: ``project`` (q, k) ->
        (qh (..., n, h), kh (..., m, h), w_v (h,)), applied once the call is taken;
        ``hidden`` = h (the work per score). A backend that takes the call returns the
        weights it used with the output (the module keeps no copies for them)."""

    def all_finite(self, tensors: Sequence[Tensor]) -> bool:
        """Whether every entry of every tensor is finite (no NaN, no inf): one read of each.
        Fused kernels take a call only then (see :func:`attnscore.kernels._attention.
        finite_inputs`)."""

    def matmul(self, a: Tensor, b: Tensor) -> Tensor:
        """float16 a (..., r, k) @ b (k, c), or (..., k, c) with a's leading dimensions ->
        (..., r, c) in float16, accumulated in float32 as ``torch.matmul`` does. Asked for
        float16 only: every other dtype is ``torch.matmul``'s on every device."""


#: The contract's functions, one per op and direction: the Protocol's methods, in order.
FUNCTIONS: tuple[str, ...] = tuple(name for name in vars(Backend) if not name.startswith("_"))

if TYPE_CHECKING:  # the backends implement the whole contract (checked by mypy)
    from . import _cpu, _cuda

    _PLAIN: Backend = _plain
    _CPU: Backend = _cpu
    _CUDA: Backend = _cuda

_modules: dict[str, ModuleType | None] = {}
_errors: dict[str, str] = {}
_forced: dict[str, ModuleType | None] = {}
_import_lock = threading.Lock()
_override: bool | None = None


class _Local(threading.local):
    """:func:`disabled` is per thread, like ``torch.no_grad``: one thread's plain-path block
    must not switch paths under another thread's call. The default lives on the class: a
    miss on a ``threading.local`` raises and catches inside, on every call."""

    disabled = 0


_local = _Local()


def _env_enabled() -> bool:
    return os.environ.get("ATTNSCORE_DISABLE_KERNELS", "") in ("", "0")


# The environment variable, read at import and by set_enabled(None) (not per call: reading
# os.environ costs about a microsecond, which every small call would pay several times).
_env = _env_enabled()


def enabled() -> bool:
    """Whether backends other than the plain one may be used in this thread.

    :func:`disabled` (this thread) wins over :func:`set_enabled` (process-wide), which wins
    over the ``ATTNSCORE_DISABLE_KERNELS`` environment variable (read when attnscore is
    imported, and again by ``set_enabled(None)``).
    """
    if _local.disabled:
        return False
    return _env if _override is None else _override


def exporting() -> bool:
    """Whether ``torch.export`` is tracing (``torch.export.export``, and
    ``torch.onnx.export(..., dynamo=True)``, which runs it). An exported program must run
    without attnscore, at every size its dynamic dimensions allow, and must carry no opaque
    op an exporter cannot translate: every op then runs its plain PyTorch formulation, in
    one block (see :mod:`attnscore.kernels._ops`)."""
    return bool(torch.compiler.is_exporting())


def set_enabled(flag: bool | None) -> None:
    """Force fast backends on (True) or off (False) process-wide; None defers to the
    ``ATTNSCORE_DISABLE_KERNELS`` environment variable, read again now."""
    global _override, _env
    _override = flag
    if flag is None:
        _env = _env_enabled()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Run the body on the plain PyTorch twins, in this thread only (nests)."""
    _local.disabled = _local.disabled + 1
    try:
        yield
    finally:
        _local.disabled -= 1


@contextlib.contextmanager
def use_backend(device_type: str, module: ModuleType | str) -> Iterator[None]:
    """Use ``module`` as the backend of ``device_type`` inside the body (process-wide):
    a module, or a module's name, imported as a :data:`BACKENDS` row is (one that cannot
    be imported means the plain backend, and :func:`backend_name` says why).

    For tests: run a backend module on tensors of another device (e.g. Triton kernels
    under ``TRITON_INTERPRET=1`` on CPU tensors), force the plain one
    (``use_backend("cpu", attnscore.kernels._plain)``), or see what a row that fails to
    import gives.
    """
    previous, error = _forced.get(device_type, _UNSET), _errors.get(device_type)
    _forced[device_type] = (
        module if isinstance(module, ModuleType) else _imported(device_type, module)
    )
    try:
        yield
    finally:
        if previous is _UNSET:
            del _forced[device_type]
        else:
            _forced[device_type] = previous
        if error is None:
            _errors.pop(device_type, None)
        else:
            _errors[device_type] = error


_UNSET: Any = object()


def _imported(device_type: str, name: str) -> ModuleType | None:
    """The module ``name``, or None (noting why for :func:`backend_name`) where it or what
    it needs (triton) cannot be imported."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        _errors[device_type] = f"{type(exc).__name__}: {exc}"
        return None


def _module(device_type: str) -> ModuleType | None:
    if device_type in _forced:
        return _forced[device_type]
    if device_type in _modules:
        return _modules[device_type]
    name = BACKENDS.get(device_type)
    with _import_lock:
        module = None if name is None else _imported(device_type, name)
        _modules[device_type] = module
    return module


def backend_function(device_type: str, function: str) -> Callable[..., Any]:
    """The backend's implementation of a contract ``function`` on ``device_type``, or the
    plain backend's when the device type has no backend, its module cannot be imported,
    or it leaves that function out."""
    module = _module(device_type)
    fn = getattr(module, function, None) if module is not None else None
    if fn is None:
        fn = getattr(_plain, function)
    return fn  # type: ignore[no-any-return]


def backend_for(tensor: Tensor, function: str) -> Callable[..., Any]:
    """:func:`backend_function` of ``tensor``'s device type (a CPU tensor's told apart
    without building its ``torch.device``: a fifth of a microsecond per call)."""
    return backend_function("cpu" if tensor.is_cpu else tensor.device.type, function)


def backend_name(device_type: str, function: str) -> str:
    """Which module runs ``function`` on ``device_type`` (for reports), with the reason when
    it is the plain one."""
    module = _module(device_type)
    if module is not None and getattr(module, function, None) is not None:
        return module.__name__
    why = _errors.get(device_type) or (
        "no backend for this device type" if module is None else "not provided"
    )
    return f"{_plain.__name__} ({why})"
