"""Lazily sized projections that a checkpoint sizes as a first call would."""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["LazyLinear"]


class LazyLinear(nn.LazyLinear):
    """``nn.LazyLinear(out_features, bias)`` that becomes an ``nn.Linear`` of the loaded
    size when ``load_state_dict`` gives it a materialised weight, as its first call would
    (PyTorch's leaves ``in_features`` at 0 and the module lazy until a call, so checks that
    read ``in_features`` fail and its ``repr`` shows 0).

    State-dict keys (``weight``, ``bias``) are ``nn.LazyLinear``'s and ``nn.Linear``'s, so
    checkpoints load either way; a checkpoint of a module never called (uninitialised
    parameters) leaves it lazy.

    >>> import torch
    >>> LazyLinear(2)  # before its first call
    LazyLinear(in_features=None, out_features=2, bias=True)
    >>> trained = LazyLinear(2)
    >>> _ = trained(torch.ones(1, 5))
    >>> fresh = LazyLinear(2)
    >>> _ = fresh.load_state_dict(trained.state_dict())
    >>> fresh
    Linear(in_features=5, out_features=2, bias=True)
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
            return  # nothing sized it (a checkpoint of a module never called)
        self.in_features = self.weight.shape[1]
        # What the first call does once the parameters exist: drop the lazy hooks and
        # become nn.Linear (LazyModuleMixin's own step; it reads no input when sized).
        self._infer_parameters(self, (self.weight,))
