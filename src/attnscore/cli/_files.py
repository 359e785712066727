"""One policy for the files a command writes, shared by every subcommand.

- The format follows the extension: figures are ``.png``, ``.pdf`` or ``.svg`` (drawn by
  matplotlib in that format); anything else is refused before any work.
- A missing folder is refused, naming the path; it is never created silently (``g2p
  train --out``, whose default ``runs/g2p`` is made with its parents, aside).
- An existing file is never replaced unless the command's ``--overwrite`` says so: it is
  refused before any work (:func:`check_output`, :func:`check_folder`), and once more when
  the file is put in place, should it have appeared meanwhile (:func:`write_atomic`).
- Files are written through a temporary file in the same folder and renamed into place,
  so a failure leaves no partial file; the mode follows the umask, as ``open()`` would.

Every refusal is a :class:`~attnscore.cli._usage.UsageError` naming the option.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

from ._usage import UsageError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE_FORMATS = (".png", ".pdf", ".svg")


def _exists(path: Path, option: str) -> UsageError:
    return UsageError(f"{option}: {path} exists; pass --overwrite to replace it")


def _check_ancestors(folder: Path, option: str, *, create: bool) -> None:
    """Refuse a ``folder`` to write into that is a file, lies under a file, or (unless
    ``create``) does not exist."""
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing.exists() and not existing.is_dir():
        raise UsageError(f"{option}: {existing} is a file, not a folder")
    if not create and not folder.is_dir():
        raise UsageError(f"{option}: folder {folder} does not exist; create it first")


def _check_replaceable(path: Path, option: str, overwrite: bool) -> None:
    """Refuse an existing ``path``: a folder or a special file always, a file unless
    ``overwrite``."""
    if path.is_dir():
        raise UsageError(f"{option}: {path} is a folder; expected a file name")
    if path.exists() and not path.is_file():
        raise UsageError(f"{option}: {path} is not a regular file; expected a file name")
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise _exists(path, option)


def check_output(
    path: Path, option: str, suffixes: Sequence[str], *, overwrite: bool = False
) -> Path:
    """Refuse an output ``path``, named by ``option``, that cannot be written as asked, before
    any work is done; return it.

    UsageError: ``path`` is a folder or a special file, its extension is not one of
    ``suffixes`` (lower case, with the dot), its folder does not exist or is a file, or it
    exists and ``overwrite`` (the command's ``--overwrite``) is false.

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
    _check_ancestors(path.parent, option, create=False)
    _check_replaceable(path, option, overwrite)
    return path


def check_folder(
    path: Path,
    option: str,
    *,
    files: Iterable[str] = (),
    overwrite: bool = False,
    parents: bool = False,
) -> Path:
    """Refuse an output folder ``path`` (created by the command if missing), named by
    ``option``, that cannot be used as asked, before any work is done; return it.

    UsageError: ``path`` (or a folder above it) is a file; its parent does not exist (unless
    the command creates ``parents`` too); one of ``files`` (the names the command will
    write in it) is a folder or a special file there, or exists while ``overwrite`` is false.

    >>> check_folder(Path("no/such/folder"), "--out")
    Traceback (most recent call last):
    ...
    attnscore.cli._usage.UsageError: --out: folder no/such does not exist; create it first
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{option}: {path} is a file; expected a folder")
    _check_ancestors(path.parent, option, create=parents)
    if path.is_dir():
        for name in files:
            _check_replaceable(path / name, option, overwrite)
    return path


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _place_new(tmp: str, path: Path, option: str) -> None:
    """Move ``tmp`` to ``path`` unless a file appeared there: a hard link fails where
    ``path`` exists, so a file made since :func:`check_output` is never replaced."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        raise _exists(path, option) from None
    except OSError:  # a file system without hard links: check, then rename
        if os.path.lexists(path):
            raise _exists(path, option) from None
        os.replace(tmp, path)


def write_atomic(
    path: Path, write: Callable[[BinaryIO], object], option: str, *, overwrite: bool = False
) -> None:
    """Write ``path`` (named by ``option``) through ``write(binary file)`` into a temporary
    file in its folder, then rename it into place.

    The file gets mode ``0o666 & ~umask`` (as ``open(path, "w")`` would); on any failure,
    including one raised by ``write``, no file is left at ``path`` or beside it, and a file
    already at ``path`` is unchanged. Without ``overwrite`` a file found there (one made
    after :func:`check_output` looked) is kept and refused. UsageError: the folder does not
    exist or cannot be written, or ``path`` exists and ``overwrite`` is false.
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
        if overwrite:
            os.replace(tmp, path)
        else:
            _place_new(tmp, path, option)
    except OSError as err:
        raise UsageError(f"{option}: cannot write {path}: {err.strerror or err}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def save_figure(
    fig: Figure, path: Path, option: str, *, dpi: int = 120, overwrite: bool = False
) -> None:
    """Save ``fig`` in the format its extension names (png, pdf or svg), whole and atomically.

    The bounding box is fitted to what is drawn, so axis labels and titles are never cut;
    ``option`` and ``overwrite`` as in :func:`check_output` and :func:`write_atomic`.
    """
    path = check_output(Path(path), option, FIGURE_FORMATS, overwrite=overwrite)
    fmt = path.suffix.lower().lstrip(".")
    write_atomic(
        path,
        lambda f: fig.savefig(f, format=fmt, dpi=dpi, bbox_inches="tight"),
        option,
        overwrite=overwrite,
    )
