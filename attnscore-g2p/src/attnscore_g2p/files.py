"""Files a G2P run writes, written whole or not at all."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

__all__ = ["write_atomic", "write_text_atomic"]


def write_atomic(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` through ``write(binary file)`` into a temporary file beside it, then
    rename it into place: a run stopped while writing (Ctrl-C, a kill) leaves the previous
    file, or none, and no partial or temporary file.

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> write_atomic(folder / "a.bin", lambda f: f.write(b"abc"))
    >>> sorted(p.name for p in folder.iterdir()), (folder / "a.bin").read_bytes()
    (['a.bin'], b'abc')
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def write_text_atomic(path: Path, text: str) -> None:
    """:func:`write_atomic` of ``text`` in UTF-8."""
    write_atomic(path, lambda f: f.write(text.encode()))
