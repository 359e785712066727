"""The checks a checkpoint's plain data passes before anything is built from it.

Each record of a checkpoint (:class:`~attnscore_g2p.config.TrainConfig` with its
:class:`~attnscore_g2p.config.ModelConfig`, :class:`~attnscore_g2p.state.TrainState` with its
validations) is a dict read from a file someone may have edited, truncated or crafted.
:func:`record_problems` checks every field it names against the field's declared type and
range, and returns one readable line per bad entry (none: the dict is safe to build from).
Unknown keys are ignored, as ``from_dict`` ignores them.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

from attnscore.registry import scorer_names

from .config import PRECISIONS

__all__ = ["MAX_LAYERS", "MAX_WIDTH", "RANGES", "record_problems"]

MAX_WIDTH = 1 << 16
"""The largest embedding or hidden size a checkpoint may name (the recipe's is 256)."""
MAX_LAYERS = 64
"""The most encoder layers a checkpoint may name (the recipe's is 1)."""


def _width(v: Any) -> str | None:
    return None if 1 <= v <= MAX_WIDTH else f"between 1 and {MAX_WIDTH}"


def _fraction(v: Any) -> str | None:
    return None if 0 <= v < 1 else "in [0, 1)"


def _positive(v: Any) -> str | None:
    return None if v > 0 else "positive"


def _non_negative(v: Any) -> str | None:
    return None if v >= 0 else "non-negative"


def _one_of(names: Callable[[], Any]) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if v in names() else "one of " + ", ".join(names())

    return check


RANGES: dict[str, Callable[[Any], str | None]] = {
    "scoring": _one_of(scorer_names),
    "precision": _one_of(lambda: PRECISIONS),
    "emb": _width,
    "enc_hidden": _width,
    "dec_hidden": _width,
    "enc_layers": lambda v: None if 1 <= v <= MAX_LAYERS else f"between 1 and {MAX_LAYERS}",
    "dropout": _fraction,
    "batch_size": _positive,
    "lr": _positive,
    "steps": _positive,
    "average_last": _fraction,
    "threads": _positive,
    "nprocs": _positive,
    "epoch": _non_negative,
    "batch": _non_negative,
    "step": _non_negative,
    "loss_steps": _non_negative,
    "averaged_steps": _non_negative,
}
"""Field name -> a check of its value's range, returning what was expected or None. A
name means the same in every record it appears in."""


def _is(kind: str, v: Any) -> bool:
    if kind == "int":
        return isinstance(v, int) and not isinstance(v, bool)
    if kind == "float":
        return isinstance(v, int | float) and not isinstance(v, bool)
    if kind == "str":
        return isinstance(v, str)
    if kind == "bool":
        return isinstance(v, bool)
    if kind == "None":
        return v is None
    raise AssertionError(f"no check for the field type {kind!r}")  # pragma: no cover


def _describe(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def record_problems(cls: type, d: Any, where: str) -> list[str]:
    """One line per entry of ``d`` that the dataclass ``cls`` could not safely be built
    from: not a dict, a field of the wrong type, or a value out of its range
    (:data:`RANGES`); nested records and lists of records are checked in turn.

    Args:
        cls: a :class:`~attnscore_g2p.config.Record` dataclass.
        d: what the file holds in its place.
        where: its name in messages (``"train_config"``).

    Returns:
        The problems, each ``"<where>.<field>: expected <what>, but got <value>"``.

    >>> from attnscore_g2p.config import ModelConfig
    >>> for line in record_problems(ModelConfig, {"enc_hidden": "abc", "dropout": 1.5}, "m"):
    ...     print(line)
    m.enc_hidden: expected int, but got 'abc'
    m.dropout: expected in [0, 1), but got 1.5
    """
    if not isinstance(d, Mapping):
        return [f"{where}: expected a dict, but got a {type(d).__name__}"]
    hints = typing.get_type_hints(cls)
    problems: list[str] = []
    for f in dataclasses.fields(cls):
        if f.name not in d:
            continue
        v, name, hint = d[f.name], f"{where}.{f.name}", hints[f.name]
        if dataclasses.is_dataclass(hint):
            problems += record_problems(typing.cast(type, hint), v, name)
            continue
        if typing.get_origin(hint) is list:
            (item,) = typing.get_args(hint)
            if not isinstance(v, list):
                problems.append(f"{name}: expected a list, but got a {type(v).__name__}")
            else:
                for i, entry in enumerate(v):
                    problems += record_problems(item, entry, f"{name}[{i}]")
            continue
        kinds = [getattr(k, "__name__", str(k)).replace("NoneType", "None") for k in
                 (typing.get_args(hint) or (hint,))]  # fmt: skip
        if not any(_is(k, v) for k in kinds):
            problems.append(f"{name}: expected {' or '.join(kinds)}, but got {_describe(v)}")
            continue
        bad_range = RANGES.get(f.name)
        if v is not None and bad_range is not None and (expected := bad_range(v)) is not None:
            problems.append(f"{name}: expected {expected}, but got {_describe(v)}")
    return problems
