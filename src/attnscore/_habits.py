"""PyTorch's attention arguments, and what attnscore takes instead.

A keyword argument that no attnscore entry point takes is refused with one ``TypeError``;
where it is an argument of ``F.scaled_dot_product_attention`` or ``nn.MultiheadAttention``
(a habit a PyTorch user brings along), the error names attnscore's equivalent, with each
mask's polarity; the hints are the package's habits.json. ``docs/coming_from_pytorch.md`` is
the same table for readers.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Literal, TypeVar

from typing_extensions import ParamSpec

Where = Literal["function", "forward", "multihead forward", "MultiHeadAttention"]
"""Who takes the keywords: a functional form of :mod:`attnscore.functional`, the
``forward`` of an attention module, :class:`~attnscore.MultiHeadAttention`'s ``forward``,
or its constructor."""

_CALLS: tuple[Where, ...] = ("function", "forward", "multihead forward")
_ORIGINS = {
    "sdpa": "F.scaled_dot_product_attention's",
    "mha": "nn.MultiheadAttention's",
    "both": "F.scaled_dot_product_attention's and nn.MultiheadAttention's",
}


@dataclass(frozen=True)
class Habit:
    """A PyTorch argument: whose it is, attnscore's equivalent (``hint``), and where the
    hint differs (``hints`` by :data:`Where`); ``where``: the entry points it is refused at
    (where it is taken under the same name, it means the same)."""

    origin: str
    hint: str
    where: tuple[Where, ...] = _CALLS
    hints: Mapping[Where, str] = field(default_factory=dict)

    def hint_for(self, where: Where) -> str:
        return self.hints.get(where, self.hint)


# The hints are data (habits.json, shipped in the wheel): the error messages' text.
_TABLE = json.loads(resources.files("attnscore").joinpath("habits.json").read_text("utf-8"))
HABITS: dict[str, Habit] = {
    name: Habit(
        _ORIGINS[entry["origin"]],
        entry["hint"],
        tuple(entry.get("where", _CALLS)),
        entry.get("hints", {}),
    )
    for name, entry in _TABLE.items()
}
"""Every argument of ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` that
some attnscore entry point does not take under the same name and meaning, by name."""


def check_keywords(given: Collection[str], accepted: Collection[str], where: Where) -> None:
    """Refuse the keywords among ``given`` that are not ``accepted``, with one TypeError:
    for a PyTorch argument (:data:`HABITS`), naming attnscore's equivalent; otherwise
    listing what is accepted. Cheap when every keyword is accepted (the common case)."""
    unknown = [name for name in given if name not in accepted]
    if not unknown:
        return
    for name in unknown:
        habit = HABITS.get(name)
        if habit is not None and where in habit.where:
            raise TypeError(
                f"Unexpected keyword argument `{name}` ({habit.origin}): {habit.hint_for(where)}."
            )
    raise TypeError(
        f"Unexpected keyword argument(s) {sorted(unknown)}: expected keywords among "
        f"{sorted(accepted)}."
    )


P = ParamSpec("P")
R = TypeVar("R")


def refuses_pytorch_keywords(where: Where) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a constructor so that a keyword it does not take is refused by
    :func:`check_keywords` (naming attnscore's equivalent of a PyTorch argument) rather
    than by Python's bare ``unexpected keyword argument``; its signature is unchanged."""

    def decorate(init: Callable[P, R]) -> Callable[P, R]:
        names = frozenset(inspect.signature(init).parameters) - {"self"}

        @functools.wraps(init)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            check_keywords(kwargs, names, where)
            return init(*args, **kwargs)

        return checked

    return decorate
