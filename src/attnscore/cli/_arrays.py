"""Reading ``attnscore run --input``: the named arrays of a ``.npz`` or ``.pt`` file.

Nothing is unpickled: ``.npz`` files are read with ``allow_pickle=False`` and ``.pt`` files
with ``weights_only=True``. Every refusal is one :class:`~attnscore.cli._usage.UsageError`
line naming ``--input``.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from ._usage import UsageError

if TYPE_CHECKING:
    from torch import Tensor

ARRAY_FORMATS = (".npz", ".pt")
"""The extensions of the array files ``attnscore run`` reads and writes."""
ARRAY_NAMES = "queries, keys, values (and optionally valid_lens)"
"""The arrays an input file holds, for messages and help."""
_EXPECTED_NPZ = f"expected a zip of arrays named {ARRAY_NAMES}, as numpy.savez writes"
_EXPECTED_PT = f"expected a dict of tensors named {ARRAY_NAMES}, as torch.save writes"


def _load_npz(path: Path) -> dict[str, object]:
    import numpy as np
    import torch

    if not zipfile.is_zipfile(path):
        raise UsageError(f"--input: cannot read {path}: it is not an .npz archive; {_EXPECTED_NPZ}")
    arrays: dict[str, object] = {}
    try:
        with np.load(path, allow_pickle=False) as data:
            for name in data.files:
                try:
                    arrays[name] = torch.from_numpy(data[name])
                except ValueError as err:
                    if "allow_pickle" not in str(err):
                        raise
                    arrays[name] = data[name].dtype  # object arrays: reported below
                except TypeError:  # dtypes torch lacks (strings, complex256, ...)
                    arrays[name] = data[name].dtype
    except (OSError, ValueError, EOFError, KeyError, zipfile.BadZipFile):
        raise UsageError(
            f"--input: cannot read {path}: a damaged .npz archive; {_EXPECTED_NPZ}"
        ) from None
    return arrays


def _load_pt(path: Path) -> dict[str, object]:
    import torch

    try:
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch.load raises many types (KeyError, RuntimeError, EOFError...)
        refused = isinstance(err, pickle.UnpicklingError)
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(err)) if refused else None
        if found is not None:
            raise UsageError(
                f"--input: {path} holds objects other than tensors ({found.group(1)}), which "
                f"are never unpickled; {_EXPECTED_PT}"
            ) from None
        # not a pickle torch can read: corrupt or another format
        raise UsageError(
            f"--input: cannot read {path}: not a file written by torch.save; {_EXPECTED_PT}"
        ) from None
    if not isinstance(loaded, dict):
        raise UsageError(
            f"--input: expected {path} to hold a dict of tensors named {ARRAY_NAMES}, but it "
            f"holds a {type(loaded).__name__}"
        )
    return {str(name): value for name, value in loaded.items()}


def load_arrays(path: Path) -> dict[str, Tensor]:
    """``queries``, ``keys``, ``values`` and, when it has it, ``valid_lens`` of an ``attnscore
    run --input`` file (``.npz`` from ``numpy.savez``, ``.pt`` from ``torch.save`` of a
    dict), as CPU tensors; other arrays are left out. UsageError: a missing file, a folder,
    another extension, a damaged or foreign file, objects other than tensors, a missing
    array or a non-numeric one.

    >>> load_arrays(Path("no-such-file.npz"))
    Traceback (most recent call last):
    ...
    attnscore.cli._usage.UsageError: --input: no such file: no-such-file.npz
    """
    import torch

    if not path.exists():
        raise UsageError(f"--input: no such file: {path}")
    if not path.is_file():
        raise UsageError(f"--input: {path} is a folder; expected a .npz or .pt file")
    suffix = path.suffix.lower()
    if suffix not in ARRAY_FORMATS:
        raise UsageError(f"--input: expected a .npz or .pt file, but got {path.name}")
    arrays = _load_npz(path) if suffix == ".npz" else _load_pt(path)
    missing = [name for name in ("queries", "keys", "values") if name not in arrays]
    if missing:
        raise UsageError(
            f"--input: {path} lacks array(s) {missing}; it has {sorted(arrays)}, but expected "
            f"arrays named {ARRAY_NAMES}"
        )
    tensors: dict[str, Tensor] = {}
    for name in ("queries", "keys", "values", "valid_lens"):
        if name not in arrays:
            continue
        value = arrays[name]
        if not isinstance(value, torch.Tensor):
            got = f"dtype {value}" if suffix == ".npz" else type(value).__name__
            raise UsageError(f"--input: expected `{name}` in {path} to be numeric, but got {got}")
        tensors[name] = value
    return tensors
