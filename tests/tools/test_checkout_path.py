"""The tools the suite runs do not depend on the folder the checkout lives in: a clone is
named ``attnscore`` by ``git clone``, so its package lives in ``.../attnscore/src/attnscore/``
and any path cut at the first ``/attnscore/`` keeps ``src/attnscore/`` in front."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROGRAM = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("call_trace", sys.argv[1])
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)
import attnscore
assert attnscore.__file__.startswith(sys.argv[2]), attnscore.__file__
calls = tool.trace(True, (2, 16, 16, 8))
print(repr(calls))
"""


def test_call_trace_names_package_files_in_a_clone_named_attnscore(tmp_path):
    clone = tmp_path / "attnscore"  # what `git clone .../attnscore` creates
    clone.mkdir()
    for part in ("src", "tools"):
        (clone / part).symlink_to(ROOT / part, target_is_directory=True)
    env = {**os.environ, "PYTHONPATH": str(clone / "src")}
    done = subprocess.run(
        [sys.executable, "-c", PROGRAM, str(clone / "tools" / "call_trace.py"), str(clone)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    calls = ast.literal_eval(done.stdout)
    # the same files as tests/kernels/test_select.py's call-trace test names
    assert calls[0] == ("modules.py", "forward")
    assert ("kernels/_select.py", "planned") in calls
