"""Helpers shared by the command-line tests (imported as ``clitools``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

import attnscore

SRC = str(Path(attnscore.__file__).parents[1])


def python_m(*args: object, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``python -m attnscore ARGS`` on this checkout's package, in a fresh process."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, "-m", "attnscore", *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
    )


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
