"""Compile the C kernels on first use and load them with ctypes.

Why plain C + ctypes rather than ``torch.utils.cpp_extension``: compiling against the torch
C++ headers takes about a minute and needs ninja, while this single C file builds in well under
a second with the system compiler, and ctypes releases the GIL during calls so Python threads can
drive several cores. The shared object is cached under ``$ATTNSCORE_CACHE`` (default
``~/.cache/attnscore``) keyed by a hash of source, flags, compiler version and CPU flags
(``-march=native`` output must never be reused on a different CPU). The build writes a temporary
file and renames it, so parallel processes cannot load a half-written library. Any failure
(no compiler, no write access, load error) warns once and leaves the kernels unavailable, so
callers fall back to the PyTorch implementations.

**OpenMP.** When torch runs on libgomp (the Linux wheels bundle it) the library is built
with ``-fopenmp``: loading it then reuses the libgomp torch loaded (same soname), and its
``*_par`` drivers run row ranges on torch's own OpenMP threads. That matters under
``torch.compile``, whose kernels leave those threads spinning for a while after each
parallel region: a second pool of threads (Python's) would compete with them for the
cores. If a second libgomp gets mapped after all, or ``ATTNSCORE_OPENMP=0`` is set, or the
``-fopenmp`` build fails, the kernels run on Python threads instead (:func:`parallel_in_c`
is False).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

_SOURCE = Path(__file__).with_name("csrc") / "attnscore_kernels.c"

# Compiling and linking are two steps, and only compiling sees -ffast-math: a link with it
# pulls in gcc's crtfastmath.o, whose constructor turns on flush-to-zero and
# denormals-are-zero for the whole process when the library loads (every later float op of
# the user's, torch's and NumPy's included). -ffast-math is needed for glibc to declare its
# vector expf/tanhf (libmvec); the kernels never read padded positions, and they test for
# NaN and inf on the bits, so finite-math assumptions only concern the arithmetic.
# -fopenmp-simd honours `#pragma omp simd` without linking an OpenMP runtime.
CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp-simd", "-fPIC"]
LDFLAGS = ["-shared"]
#: The build that shares torch's libgomp (see the module docstring): -fopenmp in both steps.
OPENMP_CFLAGS = [f for f in CFLAGS if f != "-fopenmp-simd"] + ["-fopenmp"]
OPENMP_LDFLAGS = [*LDFLAGS, "-fopenmp"]
#: Extra flags for both steps, from the environment (the sanitizer build of ``nox -s
#: sanitize``: ``-fsanitize=address,undefined ...``); part of the cache key.
EXTRA_FLAGS_ENV = "ATTNSCORE_CFLAGS"


@dataclass
class BuildInfo:
    """What happened on the first load: path, whether compiled, and seconds taken."""

    path: str | None = None
    compiled: bool = False
    seconds: float = 0.0
    error: str | None = None
    openmp: bool = False

    def as_dict(self) -> dict[str, object]:
        """The fields by name (what ``attnscore bench`` records)."""
        return asdict(self)


_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_info = BuildInfo()


def build_info() -> BuildInfo:
    """Information about the (attempted) build; call after :func:`load_library`."""
    return _info


def _compiler() -> str | None:
    for name in (os.environ.get("CC", ""), "cc", "gcc", "clang"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    env = os.environ.get("ATTNSCORE_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attnscore"


def _loaded_gomp() -> set[str]:
    """The libgomp files mapped into this process (Linux; empty elsewhere)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return set()
    paths = (line.split(maxsplit=5) for line in maps.splitlines())
    return {p[5] for p in paths if len(p) == 6 and "libgomp" in p[5].rsplit("/", 1)[-1]}


def _want_openmp() -> bool:
    """Build with -fopenmp: torch has exactly one libgomp loaded and the user allows it."""
    if os.environ.get("ATTNSCORE_OPENMP", "") in ("0", "false", "no"):
        return False
    return len(_loaded_gomp()) == 1


def has_float16() -> bool:
    """Whether the loaded library has float16 kernels (the compiler knew F16C or _Float16);
    False when the library is not loaded."""
    return _lib is not None and bool(_lib.attnscore_have_f16())


def parallel_in_c() -> bool:
    """Whether the loaded kernels run their row ranges on torch's OpenMP threads (else on
    Python threads); False when the library is not loaded, or inside
    :func:`python_threads`. (:data:`state` holds it for the kernels' every call.)"""
    return _lib is not None and _info.openmp and not _python_threads


class _State:
    """What the kernels read on every call, as attributes (no call): ``lib``, the loaded
    library (None before, or without one), and ``parallel``, the value of
    :func:`parallel_in_c`, set again whenever it may change."""

    lib: ctypes.CDLL | None = None
    parallel = False


state = _State()
_python_threads = 0


@contextlib.contextmanager
def python_threads() -> Iterator[None]:
    """Run the C kernels' work on a Python thread pool (ctypes releases the GIL) instead of
    torch's OpenMP threads inside the body (process-wide; nests): what a library built
    without OpenMP does, e.g. to tell a threading problem from a kernel's. Results are the
    same either way.

    >>> import torch
    >>> import attnscore.kernels as K
    >>> with K.python_threads():
    ...     K.masked_softmax(torch.zeros(2, 3), torch.tensor([2, 0])).sum().item()
    1.0
    """
    global _python_threads
    _python_threads += 1
    state.parallel = parallel_in_c()
    try:
        yield
    finally:
        _python_threads -= 1
        state.parallel = parallel_in_c()


def _build(cc: str, cflags: list[str], ldflags: list[str]) -> tuple[Path, bool]:
    source = _SOURCE.read_bytes()
    version = subprocess.run(
        [cc, "--version"], capture_output=True, text=True, check=True, timeout=60
    ).stdout
    extra = os.environ.get(EXTRA_FLAGS_ENV, "").split()
    cflags, ldflags = [*cflags, *extra], [*ldflags, *extra]
    named = (" ".join(cflags), " ".join(ldflags), version, _cpu_flags(), platform.machine())
    key = hashlib.sha256()
    for part in (source, *(text.encode() for text in named)):
        key.update(part)
        key.update(b"\0")
    out_dir = _cache_dir()
    target = out_dir / f"attnscore_kernels_{key.hexdigest()[:16]}.so"
    if target.exists():
        return target, False
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp_dir:
        obj, lib = Path(tmp_dir) / "kernels.o", Path(tmp_dir) / "kernels.so"
        for step in (
            [cc, *cflags, "-c", "-o", str(obj), str(_SOURCE)],
            [cc, *ldflags, "-o", str(lib), str(obj), "-lm"],  # no -ffast-math: see CFLAGS
        ):
            proc = subprocess.run(step, capture_output=True, text=True, timeout=300)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[:2000]}")
        os.replace(lib, target)  # atomic: other processes see all or nothing
    return target, True


def load_library() -> ctypes.CDLL | None:
    """Return the loaded kernel library, building it if needed; None if unavailable."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        start = time.perf_counter()
        try:
            cc = _compiler()
            if cc is None:
                raise RuntimeError("no C compiler found (tried $CC, cc, gcc, clang)")
            lib, path, compiled = _build_and_load(cc)
            _declare(lib)
            _info.path, _info.compiled = str(path), compiled
            # Shared with torch only if loading it mapped no second libgomp.
            _info.openmp = bool(lib.attnscore_openmp()) and len(_loaded_gomp()) == 1
            _lib = lib
        except Exception as exc:  # any failure means: use the PyTorch fallback
            _info.error = f"{type(exc).__name__}: {exc}"
            warnings.warn(
                f"attnscore: C kernels unavailable, using PyTorch fallbacks ({_info.error})",
                RuntimeWarning,
                stacklevel=2,
            )
        _info.seconds = time.perf_counter() - start
        _tried = True
        state.lib, state.parallel = _lib, parallel_in_c()
        return _lib


def _build_and_load(cc: str) -> tuple[ctypes.CDLL, Path, bool]:
    """Build (or find cached) and load the library: with -fopenmp when wanted, falling back
    to the build without an OpenMP runtime if that fails."""
    if _want_openmp():
        try:
            return _load(cc, OPENMP_CFLAGS, OPENMP_LDFLAGS)
        except (RuntimeError, OSError, subprocess.SubprocessError):
            pass  # e.g. no libgomp to link against: build without an OpenMP runtime
    return _load(cc, CFLAGS, LDFLAGS)


def _load(cc: str, cflags: list[str], ldflags: list[str]) -> tuple[ctypes.CDLL, Path, bool]:
    path, compiled = _build(cc, cflags, ldflags)
    lib = ctypes.CDLL(str(path))
    if lib.attnscore_kernels_abi() != 15:
        raise RuntimeError(f"unexpected kernel ABI in {path}")
    return lib, path, compiled


# The C functions' arguments, a letter each (spaces group them): p a pointer, i an int64,
# d a double; R a row range (r0, r1), which the function's driver ``<name>_par_<suffix>``
# takes as (cuts, parts), and T a task counter (next, tasks), which its driver takes as
# (tasks, threads): the drivers run them on OpenMP threads. After "|": what only the driver
# takes. True: the function returns an int64 (a count, or 1 for yes), else nothing.
_EVERY, _WIDE = ("f64", "f32", "bf16", "f16"), ("f64", "f32")
_SIGNATURES: dict[str, tuple[tuple[str, ...], str, bool]] = {
    "any_nonfinite": (_EVERY, "pi", True),  # (buffer, entries) -> 1 if it holds inf or NaN
    # three (buffer, entries) at once, the first two copied to the last two (or NULL)
    "any_nonfinite3": (_EVERY, "pi pi pi pp", True),
    # one call on the calling thread, returning a count of rows: (q, k, v, lengths, out,
    # weights or NULL, rows, n, m, d, dv, div, scale); additive's (q, k, w, v, ...) with w
    # the h weights, and no scale
    "small_attention": (_WIDE, "pppppp iiiiii d", True),
    "small_additive": (_WIDE, "ppppppp iiiiii", True),
    "masked_softmax": (_EVERY, "ppp Ri ii", False),  # (..., m, div): div rows share a length
    # (..., m, div, gs): the upstream gradient's rows are gs apart (m, or 0: one row)
    "masked_softmax_backward": (_EVERY, "pppp Ri iii", False),
    "masked_softmax_dense": (_EVERY, "pppp Ri i", False),
    "mask_summary": (_EVERY, "pppp Ri ii", False),
    "lengths_mask": (_EVERY, "pp Ri i", False),
    "additive_scores": (_WIDE, "ppppp Ri iii", False),
    # its driver also takes B, to find each range's accumulators
    "additive_scores_backward": (_WIDE, "pppppppp Ri iii | i", False),
    # (A, B, C, R, rows, k, cols, A's three strides, B's three strides)
    "matmul": (("f16",), "ppp Ri iii iii iii", False),
    # (q, k, v, out, lse, order, sorted, strides, T, H, n, m, d, dv, chunks, scale)
    "flash_lengths": (("f32", "bf16", "f16"), "pppppppp Ti iiiiii d", False),
    # (q, k, v, out, grad, lse, dq, dk, dv, order, sorted, strides, T, H, n, m, d, dv, scale)
    "flash_lengths_backward": (("f32", "bf16", "f16"), "pppppppppppp Ti iiiii d", False),
}
#: The float16 functions that only move bits: in the library whether or not the compiler
#: has float16 arithmetic (the others are left out without it).
_BITS_ONLY = frozenset({"any_nonfinite", "any_nonfinite3", "mask_summary", "lengths_mask"})


def _declare(lib: ctypes.CDLL) -> None:
    types = {"p": ctypes.c_void_p, "i": ctypes.c_int64, "d": ctypes.c_double}
    lib.attnscore_advise_huge.argtypes = [ctypes.c_void_p, ctypes.c_int64]
    lib.attnscore_advise_huge.restype = None
    f16 = bool(lib.attnscore_have_f16())
    for name, (suffixes, letters, counts) in _SIGNATURES.items():
        letters, _, driver_only = letters.replace(" ", "").partition("|")
        kernel = letters.replace("R", "i").replace("T", "p")
        driver = letters.replace("R", "p").replace("T", "i") + driver_only
        for suf in suffixes:
            if suf == "f16" and not f16 and name not in _BITS_ONLY:
                continue
            declared = [(f"{name}_{suf}", kernel)]
            if driver != kernel:
                declared.append((f"{name}_par_{suf}", driver))
            for symbol, args in declared:
                fn = getattr(lib, symbol)
                fn.argtypes = [types[c] for c in args]
                fn.restype = ctypes.c_int64 if counts else None
