"""Loading and running the C kernels leaves the process's floating point as it was.

A shared library linked with -ffast-math carries gcc's crtfastmath.o, whose constructor sets
flush-to-zero and denormals-are-zero in MXCSR when the library loads: from then on every
float operation of the process (torch's, NumPy's, Python's own) turns subnormals into 0, on
the loading thread and on every thread started after it. Each check runs in a fresh
interpreter, since the state is per process and cannot be undone from Python.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from attnscore.kernels import _build

_SRC = str(Path(_build.__file__).resolve().parents[2])

# Runs every kernel through the public API (each dtype with a kernel, forward and backward,
# the small passes, the kernel by lengths, the dense mask and the additive scores), then
# reports the float state on this thread and on a thread started afterwards.
_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    import numpy as np
    import torch
    import attnscore
    from attnscore import kernels
    from attnscore.kernels import _build

    torch.set_num_threads(2)

    TINY32, TINY64, HALF = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])

    def state():  # subnormal * 0.5 (values from argv: nothing is folded at compile time)
        return {
            "torch_f32": (torch.tensor([TINY32]) * HALF).item(),
            "torch_f64": (torch.tensor([TINY64], dtype=torch.float64) * HALF).item(),
            "numpy_f32": float(np.float32(TINY32) * np.float32(HALF)),
            "python_f64": TINY64 * HALF,
        }

    before = state()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(2, 3, 40, 64, generator=g).to(dtype).requires_grad_(True)
        lens = torch.tensor([5, 64])
        attnscore.masked_softmax(x, lens).sum().backward()
        q = torch.randn(2, 4, 64, 16, generator=g).to(dtype).requires_grad_(True)
        k = torch.randn(2, 4, 80, 16, generator=g).to(dtype).requires_grad_(True)
        v = torch.randn(2, 4, 80, 16, generator=g).to(dtype).requires_grad_(True)
        dpa = attnscore.DotProductAttention()
        dpa(q, k, v, torch.tensor([7, 80])).sum().backward()  # the kernel by lengths
        allowed = torch.rand(2, 1, 64, 80, generator=g) > 0.3
        gen = attnscore.MultiplicativeAttention(16, 16).to(dtype)
        gen(q, k, v, attend_mask=allowed).sum().backward()  # a dense mask
        with torch.no_grad():
            dpa(q[:, :1, :2, :4], k[:, :1, :3, :4], v[:, :1, :3, :4], torch.tensor([1, 2]))
        if dtype in (torch.float32, torch.float64):
            add = attnscore.AdditiveAttention(16, 16, 8).to(dtype)
            add(q[:, 0], k[:, 0], v[:, 0], torch.tensor([3, 80])).sum().backward()
            with torch.no_grad():
                add(q[:, 0, :2], k[:, 0, :3], v[:, 0, :3], torch.tensor([1, 2]))
    assert _build.build_info().path is not None, _build.build_info().as_dict()

    # Subnormal inputs: the float64 reference's result, not 0.
    q = torch.randn(2, 8, 16, generator=g)
    k = torch.randn(2, 40, 16, generator=g)
    v = torch.randn(2, 40, 16, generator=g) * 1e-39
    lens = torch.tensor([5, 40])
    with torch.no_grad():
        out = attnscore.DotProductAttention()(q, k, v, lens)
    ref = attnscore.dot_product_attention(q.double(), k.double(), v.double(), lens)
    rel = ((out.double() - ref).abs().max() / ref.abs().max()).item()

    after = state()
    seen = {}
    t = threading.Thread(target=lambda: seen.update(state()))
    t.start()
    t.join()
    json.dump({"before": before, "after": after, "thread": seen, "subnormal_rel": rel},
              sys.stdout)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="the C kernels build on Linux")
def test_kernels_leave_subnormals_alone(tmp_path):
    import json

    # The library this session loaded, from its cache folder (the child computes the same
    # cache key: same source, flags, compiler and CPU), so that the child loads it without
    # compiling it again; an empty cache where this session has none.
    _build.load_library()
    built = _build.build_info().path
    cache = Path(built).parent if built else tmp_path / "cache"
    env = {**os.environ, "ATTNSCORE_CACHE": str(cache), "PYTHONPATH": _SRC}
    proc = subprocess.run(
        [sys.executable, "-c", _SCRIPT, "1e-40", "1e-310", "0.5"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    expected = {"torch_f32": 5e-41, "torch_f64": 5e-311, "numpy_f32": 5e-41, "python_f64": 5e-311}
    for when in ("before", "after", "thread"):
        for name, value in expected.items():
            assert report[when][name] == pytest.approx(value, rel=1e-3), (when, name, report)
    assert report["subnormal_rel"] < 1e-3, report
