"""One policy for the files a command writes, shared by every subcommand.

- The format follows the extension: figures are ``.png``, ``.pdf`` or ``.svg`` (drawn by
  matplotlib in that format); anything else is refused before any work.
- A missing folder is refused, naming the path; it is never created silently.
- Files are written through a temporary file in the same folder and renamed into place,
  so a failure leaves no partial file; the mode follows the umask, as ``open()`` would.

Every refusal is a :class:`~attnscore.cli._usage.UsageError` naming the option.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ._usage import UsageError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = [
    "FIGURE_FORMATS",
    "check_output",
    "save_figure",
    "write_atomic",
]

FIGURE_FORMATS = (".png", ".pdf", ".svg")


def check_output(path: Path, option: str, suffixes: Sequence[str]) -> Path:
    """Refuse an output path that cannot be written as asked, before any work is done.

    Args:
        path: the file the command will write.
        option: the option that named it (``"--heatmap"``), for the message.
        suffixes: the accepted extensions, lower case with the dot (``(".png", ".pdf")``).

    Returns:
        ``path`` unchanged.

    Raises:
        UsageError: ``path`` is a folder, its folder does not exist, or its extension is
            not one of ``suffixes``.

    >>> check_output(Path("w.txt"), "--out", (".png", ".svg"))
    Traceback (most recent call last):
    ...
    attnscore.cli._usage.UsageError: --out: expected a file ending in .png or .svg, but got w.txt
    """
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{option}: {path} is a folder; expected a file name")
    if path.suffix.lower() not in suffixes:
        allowed = (
            ", ".join(suffixes[:-1]) + f" or {suffixes[-1]}" if len(suffixes) > 1 else suffixes[0]
        )
        raise UsageError(f"{option}: expected a file ending in {allowed}, but got {path.name}")
    parent = path.parent
    if not parent.is_dir():
        raise UsageError(f"{option}: folder {parent} does not exist; create it first")
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: Path, write: Callable[[BinaryIO], object], option: str) -> None:
    """Write ``path`` through a temporary file in its folder, then rename it into place.

    The file gets mode ``0o666 & ~umask`` (as ``open(path, "w")`` would); on any failure,
    including one raised by ``write``, no file is left at ``path`` or beside it.

    Args:
        path: the file to write.
        write: writes the content into the binary file it is given.
        option: the option that named ``path``, for the message.

    Raises:
        UsageError: the folder does not exist or cannot be written.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise UsageError(f"{option}: cannot write {path}: {err.strerror or err}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except OSError as err:
        raise UsageError(f"{option}: cannot write {path}: {err.strerror or err}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_figure(fig: Figure, path: Path, option: str, *, dpi: int = 120) -> None:
    """Save ``fig`` in the format its extension names (png, pdf or svg), whole and atomically.

    The bounding box is fitted to what is drawn, so axis labels and titles are never cut.

    Args:
        fig: the figure.
        path: the file, ``.png``, ``.pdf`` or ``.svg``.
        option: the option that named ``path``, for the message.
        dpi: resolution of the png.

    Raises:
        UsageError: as :func:`check_output` and :func:`write_atomic`.
    """
    path = check_output(Path(path), option, FIGURE_FORMATS)
    fmt = path.suffix.lower().lstrip(".")
    write_atomic(path, lambda f: fig.savefig(f, format=fmt, dpi=dpi, bbox_inches="tight"), option)
