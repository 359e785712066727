"""Every size and work threshold that decides which implementation runs, as data.

One table (:data:`THRESHOLDS` of :class:`Threshold`, read from the package's
thresholds.json); the modules that use a threshold bind its value at import to a
module-level constant (``bound_as``), a global for the hot paths.
:func:`thresholds` (:func:`attnscore.kernels.thresholds`) sets other values for a ``with``
block: tests steer which implementation runs through it, not by patching private names.
A leaf module (it imports torch only), read by :mod:`attnscore._checks` and the kernels.

:func:`markdown` renders the table that docs/architecture.md shows (a test keeps the two
equal): ``python -c "from attnscore._thresholds import markdown; print(markdown(), end='')"``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType
from typing import Any

import torch

NEVER = 1 << 62  # a work no call reaches: SDPA always


@dataclass(frozen=True)
class Threshold:
    """One threshold: ``name`` (what :func:`thresholds` takes), its ``value``, what it
    ``decides`` and ``why`` (one line each), the ``machine`` it was measured on (None: not
    recorded), the bench row that ``justified_by`` it (None: no bench row does; ``note``
    says what it rests on), where it is bound (``bound_as``: ``"module:ATTRIBUTE"``), and
    the smallest value an override may take (``minimum``, ints only)."""

    name: str
    value: int | frozenset[torch.dtype] | Mapping[tuple[torch.dtype, bool], int] | Mapping[str, int]
    decides: str
    why: str
    machine: str | None
    justified_by: str | None
    note: str = ""
    bound_as: tuple[str, ...] = ()
    minimum: int | None = None


def _decoded(v: Any) -> Any:
    """A value as thresholds.json writes it: an int, ``"2^N"``, ``"never"`` (:data:`NEVER`),
    ``{"dtypes": [...]}``, ``{"per_cpu": {cpu: value}}`` or ``{"per_dtype_training":
    [[dtype, training, int], ...]}``."""
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        return NEVER if v == "never" else 1 << int(v.removeprefix("2^"))
    if "dtypes" in v:
        return frozenset(getattr(torch, d) for d in v["dtypes"])
    if "per_cpu" in v:
        return MappingProxyType({cpu: _decoded(n) for cpu, n in v["per_cpu"].items()})
    return MappingProxyType({(getattr(torch, d), t): n for d, t, n in v["per_dtype_training"]})


# The table is data (thresholds.json, shipped in the wheel): each entry names the machine and
# the bench row (or the note) behind its value.
_TABLE = json.loads(resources.files("attnscore").joinpath("thresholds.json").read_text("utf-8"))
#: The CPUs the per-CPU entries (mappings keyed by these names) were measured on, and what
#: identifies each in /proc/cpuinfo: (vendor_id, cpu family or None, a flag it has).
CPUS: dict[str, tuple[str, int | None, str]] = {
    name: (vendor, family, flag) for name, (vendor, family, flag) in _TABLE["cpus"].items()
}
THRESHOLDS: tuple[Threshold, ...] = tuple(
    Threshold(**{**entry, "value": _decoded(entry["value"]), "bound_as": tuple(entry["bound_as"])})
    for entry in _TABLE["thresholds"]
)

_BY_NAME = {t.name: t for t in THRESHOLDS}
# The values in force: the table's, or a thresholds() block's (modules imported inside a
# block bind these).
_current: dict[str, Any] = {t.name: t.value for t in THRESHOLDS}
_lock = threading.RLock()


def value(name: str) -> Any:
    """The value in force of threshold ``name`` (what a module binds at import)."""
    return _current[name]


def _checked(name: str, given: object) -> Any:
    """``given`` as a value of threshold ``name``, or the error that says why not."""
    entry = _BY_NAME.get(name)
    if entry is None:
        raise TypeError(
            f"Expected a threshold name ({', '.join(sorted(_BY_NAME))}), but got `{name}` instead."
        )
    default = entry.value
    if isinstance(default, Mapping) and all(isinstance(k, str) for k in default):
        if isinstance(given, int) and not isinstance(given, bool):  # on every CPU
            return given
        if not isinstance(given, Mapping) or not all(
            isinstance(k, str) and isinstance(v, int) for k, v in given.items()
        ):
            raise TypeError(
                f"Expected threshold `{name}` to be an int or a mapping CPU -> int, but got "
                f"{given!r} instead."
            )
        return MappingProxyType(dict(given))
    if isinstance(default, int):
        if not isinstance(given, int) or isinstance(given, bool):
            raise TypeError(
                f"Expected threshold `{name}` to be an int, but got {type(given).__name__} instead."
            )
        if entry.minimum is not None and given < entry.minimum:
            raise ValueError(
                f"Expected threshold `{name}` >= {entry.minimum}, but got {given} instead."
            )
        return given
    if isinstance(default, frozenset):
        if not isinstance(given, (set, frozenset)) or not all(
            isinstance(d, torch.dtype) for d in given
        ):
            raise TypeError(
                f"Expected threshold `{name}` to be a set of torch dtypes, but got {given!r} "
                "instead."
            )
        return frozenset(given)
    if not isinstance(given, Mapping) or not all(
        isinstance(k, tuple)
        and len(k) == 2
        and isinstance(k[0], torch.dtype)
        and isinstance(k[1], bool)
        and isinstance(v, int)
        and not isinstance(v, bool)
        for k, v in given.items()
    ):
        raise TypeError(
            f"Expected threshold `{name}` to be a mapping (dtype, training) -> int, but got "
            f"{given!r} instead."
        )
    return MappingProxyType(dict(given))


#: How many times a threshold was set (:func:`thresholds`): what was decided from the
#: values before (the kernels' kept plans) is stale once it changes.
changes = 0


def _bind(name: str, v: Any) -> None:
    """Set threshold ``name`` to ``v`` where it is in force: the modules imported so far
    that bind it (the others bind :data:`_current` when they are imported)."""
    global changes
    changes += 1
    _current[name] = v
    for where in _BY_NAME[name].bound_as:
        module, attribute = where.split(":")
        loaded = sys.modules.get(module)
        if loaded is not None:
            setattr(loaded, attribute, v)


@contextlib.contextmanager
def thresholds(**overrides: Any) -> Iterator[Mapping[str, Any]]:
    """Run the body with these thresholds (names of :data:`THRESHOLDS`) set to other
    values, process-wide; every one is restored on leaving. Yields the values in force
    (read-only). Blocks nest; a block holds a lock, so blocks of other threads wait for it
    to end (for tests: the kernels themselves never take the lock).

    Raises:
        TypeError: an unknown name (the error lists the known ones), or a value of another
            kind than the threshold's (int; set of dtypes; mapping (dtype, training) -> int).
        ValueError: an int below the threshold's smallest value (e.g. 1 for
            ``min_work_per_thread``).

    >>> from attnscore.kernels import thresholds
    >>> with thresholds(small_work=-1) as now:  # no call is small
    ...     now["small_work"]
    -1
    """
    checked = {name: _checked(name, given) for name, given in overrides.items()}
    with _lock:
        saved = {name: _current[name] for name in checked}
        try:
            for name, v in checked.items():
                _bind(name, v)
            yield MappingProxyType(_current)
        finally:
            for name, v in saved.items():
                _bind(name, v)


def _shown(v: object) -> str:
    if isinstance(v, int):
        if v == NEVER:
            return "never (SDPA)"
        if v >= 1 << 14 and v & (v - 1) == 0:
            return f"2^{v.bit_length() - 1}"
        return str(v)
    if isinstance(v, frozenset):
        return ", ".join(sorted(str(d).removeprefix("torch.") for d in v))
    assert isinstance(v, Mapping)
    return "{} (none)" if not v else ", ".join(f"{k}: {_shown(n)}" for k, n in v.items())


def markdown() -> str:
    """The table as docs/architecture.md shows it (a markdown table, one row per entry)."""
    rows = [
        "| threshold | value | decides | why | machine | justified by |",
        "|---|---|---|---|---|---|",
    ]
    for t in THRESHOLDS:
        justified = f"{t.justified_by or 'no bench row'}. {t.note}".strip()
        machine = t.machine or "not recorded"
        cells = (f"`{t.name}`", _shown(t.value), t.decides, t.why, machine, justified)
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows) + "\n"
