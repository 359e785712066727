"""Lazily sized projections that a checkpoint sizes as a first call would."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parameter import UninitializedParameter


class LazyLinear(nn.LazyLinear):
    """``nn.LazyLinear(out_features, bias)`` that becomes an ``nn.Linear`` of the loaded
    size when ``load_state_dict`` gives it a materialised weight, as its first call would
    (PyTorch's leaves ``in_features`` at 0 and the module lazy until a call, so checks that
    read ``in_features`` fail and its ``repr`` shows 0).

    State-dict keys (``weight``, ``bias``) are ``nn.LazyLinear``'s and ``nn.Linear``'s, so
    checkpoints load either way. Before its first call it has no weights to save: its
    ``state_dict`` leaves them out (so a checkpoint of a never-called module holds plain
    tensors only and loads with ``torch.load(..., weights_only=True)``), and loading such a
    checkpoint leaves the module lazy. ``.to(device or dtype)``, ``.to_empty(device=...)``
    and the like move it while it stays lazy: the first call makes its weights there.

    >>> import torch
    >>> LazyLinear(2)  # before its first call
    LazyLinear(in_features=None, out_features=2, bias=True)
    >>> trained = LazyLinear(2)
    >>> _ = trained(torch.ones(1, 5))
    >>> fresh = LazyLinear(2)
    >>> _ = fresh.load_state_dict(trained.state_dict())
    >>> fresh
    Linear(in_features=5, out_features=2, bias=True)
    >>> never_called = LazyLinear(2).to("meta")
    >>> list(never_called.state_dict()), never_called.weight.device
    ([], device(type='meta'))
    """

    def extra_repr(self) -> str:
        if not self.has_uninitialized_params():
            return str(super().extra_repr())
        # not 0, which reads as a size: the first call (or a checkpoint) gives it
        bias = self.bias is not None
        return f"in_features=None, out_features={self.out_features}, bias={bias}"

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        super()._load_from_state_dict(state_dict, prefix, *args)
        if self.has_uninitialized_params():
            # nothing sized it (a checkpoint of a module never called): its weights are not
            # missing, there are none yet
            missing_keys = args[2]
            for name, param in self._parameters.items():
                if isinstance(param, UninitializedParameter) and prefix + name in missing_keys:
                    missing_keys.remove(prefix + name)
            return
        self.in_features = self.weight.shape[1]
        # What the first call does once the parameters exist: drop the lazy hooks and
        # become nn.Linear (LazyModuleMixin's own step; it reads no input when sized).
        self._infer_parameters(self, (self.weight,))

    def _apply(self, fn: Callable[[Tensor], Tensor], recurse: bool = True) -> LazyLinear:
        if not self.has_uninitialized_params():
            return super()._apply(fn, recurse)  # type: ignore[no-any-return,no-untyped-call]
        # nn.Module._apply would turn an uninitialised parameter into an empty Parameter of
        # shape (0,) (torch 2.13), which no call can size: move the placeholder instead,
        # to where fn sends an empty tensor of its device and dtype.
        for name, param in self._parameters.items():
            if isinstance(param, UninitializedParameter):
                moved = fn(torch.empty(0, device=param.device, dtype=param.dtype))
                self._parameters[name] = UninitializedParameter(
                    param.requires_grad, device=moved.device, dtype=moved.dtype
                )
        return self

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        if self.has_uninitialized_params():
            return  # nothing to save before the first call (and nothing but tensors saved)
        super()._save_to_state_dict(destination, prefix, keep_vars)
