"""Helpers shared by the command-line tests (imported as ``clitools``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import attnscore

SRC = str(Path(attnscore.__file__).parents[1])


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}


def python_m(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m attnscore ARGS`` on this checkout's package, in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "attnscore", *map(str, args)],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=cwd,
    )


def python_m_stdout_closed(*args: object, cwd: Path | None = None) -> tuple[int, str]:
    """``python -m attnscore ARGS | head -0``: the reader of its stdout pipe closes it before
    anything is written (so every write fails). Returns the exit code and stderr."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnscore", *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_env(),
        cwd=cwd,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read().decode()
    return proc.wait(timeout=120), err


def snapshot(*folders: Path) -> dict[Path, tuple[bytes, int] | None]:
    """Everything under ``folders``: each file's bytes and mtime (None for a folder), to
    check that a command changed nothing and left nothing behind."""
    return {
        path: None if path.is_dir() else (path.read_bytes(), path.stat().st_mtime_ns)
        for folder in folders
        for path in sorted(folder.rglob("*"))
    }


def one_error_line(err: str) -> str:
    """``err`` after checking it is one ``attnscore: error: ...`` line, no traceback."""
    assert err.count("\n") == 1 and err.startswith("attnscore: error: "), err
    assert "Traceback" not in err and "\x1b" not in err
    return err


def write_inputs(path: Path, **overrides: object) -> dict[str, object]:
    """A valid ``attnscore run --input`` .npz (B=2, n=3, m=5, q=k=4, v=6; valid_lens [2, 5]);
    ``overrides`` replace arrays (None drops one). Returns the arrays written."""
    arrays: dict[str, object] = {
        "queries": np.random.default_rng(0).normal(size=(2, 3, 4)).astype(np.float32),
        "keys": np.random.default_rng(1).normal(size=(2, 5, 4)).astype(np.float32),
        "values": np.random.default_rng(2).normal(size=(2, 5, 6)).astype(np.float32),
        "valid_lens": np.array([2, 5]),
    }
    arrays.update(overrides)
    arrays = {k: v for k, v in arrays.items() if v is not None}
    np.savez(path, **arrays)  # type: ignore[arg-type]
    return arrays
