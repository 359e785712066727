"""Compile report of the Triton kernels, ahead of time and without a GPU (issue 17).

A developer tool, not part of the package (the wheel leaves tools/ out): it reads the
kernels' launchers and the benchmark's CUDA shapes from an installed or checked-out
attnscore. ``tests/kernels/test_triton_aot.py`` runs it in every test run.

Every Triton kernel is compiled for sm_80 (A100) and sm_90 (H100) at the launch
configurations its launcher picks for the benchmark shapes of
:mod:`attnscore.bench.matrix` (its CUDA shapes) and for a few odd ones, on a machine without a GPU:

* the launchers build their :class:`~attnscore.kernels._triton_launch.Launch` from
  ``meta`` tensors (shapes and dtypes, no memory), exactly as for a real call;
* a stand-in Triton driver names the target architecture, so that ``warmup()``
  specialises the arguments (alignment, divisibility by 16) as a real launch would and
  compiles to PTX and a cubin with the ptxas bundled with Triton (``ptxas-blackwell`` for
  sm_90: Triton 3.9's PTX needs it);
* registers, spill bytes, stack and static shared memory come from that ptxas's ``-v``
  log (captured while Triton compiles; for a kernel Triton took from its cache, from
  running the same ptxas again on the PTX), registers once more from ``cuobjdump
  --dump-resource-usage`` on Triton's cubin (a cross-check), dynamic shared memory from
  the compiled kernel's metadata; PTX facts (vector loads, ``tanh.approx``, float64
  instructions, shuffles, barriers) from the PTX text, exchanges between lanes inside
  loops from Triton's GPU IR, and with ``--sass`` the machine instructions of the main
  loop from ``cuobjdump -sass``.

Autotuned kernels are compiled once per candidate configuration left after pruning.

Usage (without ``TRITON_INTERPRET``: an interpreting Triton cannot compile, and Triton is
imported with attnscore, so the variable must be unset before Python starts; the test
suite, which interprets, runs this script in a fresh process), from the repository root::

    python tools/triton_aot.py                   # one line per kernel
    python tools/triton_aot.py --markdown --sass # the table of docs/benchmarks.md
    python tools/triton_aot.py --json PATH       # every result as JSON

The command sets ``TRITON_DEFAULT_FP_FUSION=1`` (Triton 3.9's default) unless it is set.
The exit status is 1 when a check fails, 2 when kernels cannot be compiled here.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, redirect_stdout
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from attnscore.bench.matrix import ADDITIVE_MEMORY as ADDITIVE_LARGE
from attnscore.bench.matrix import SHAPES
from attnscore.kernels._triton_launch import MIN_PROGRAMS, Launch, hardware_tanh

SOFTMAX = SHAPES["cuda"]["masked_softmax"]
ADDITIVE_SMALL = SHAPES["cuda"]["additive"]

#: Target architectures: compute capability -> largest shared memory per block (bytes,
#: with the opt-in carve-out: 163 KiB on A100, 227 KiB on H100).
ARCHS = {80: 163 * 1024, 90: 227 * 1024}
#: Registers per SM (both architectures).
REGS_PER_SM = 65536
#: Odd shapes: nothing a multiple of 16.
ODD = {"B": 4, "n": 100, "m": 300, "h": 100}
LONG_ROWS = {"B": 2, "n": 3, "m": 16384}
DTYPES = {
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "float64": torch.float64,
}


@dataclass(frozen=True)
class Case:
    """One launch to compile: an op at a shape and dtype.

    Attributes:
        op: ``softmax_fwd``, ``softmax_bwd``, ``additive_fwd`` or ``additive_bwd``.
        shape: label, e.g. ``B=8 n=128 m=512 h=128``.
        dtype: ``float32``, ...
        tanh: ``exact`` or ``approx`` for the additive kernels, ``""`` otherwise.
        bench: a benchmark shape (its grid must have at least MIN_PROGRAMS programs).
        build: makes the :class:`Launch` from ``meta`` tensors.
    """

    op: str
    shape: str
    dtype: str
    tanh: str
    bench: bool
    build: Callable[[], Launch] = field(compare=False, repr=False)


@dataclass
class Result:
    """One compiled kernel (a case, a configuration, an architecture) and what it shows."""

    op: str
    shape: str
    dtype: str
    tanh: str
    bench: bool
    kernel: str
    config: str
    arch: int
    grid: int
    threads: int
    regs: int
    spill_stores: int
    spill_loads: int
    stack: int
    smem: int  # static (ptxas) + dynamic (Triton's metadata), bytes per program
    cubin_bytes: int
    cuobjdump_regs: int
    vector_loads: int
    tanh_approx: int
    f64: int
    shuffles: int
    barriers: int
    loop_exchanges: int  # layout conversions and reductions inside loops (Triton GPU IR)
    loop_sass: int  # SASS instructions in the longest loop (0: no loop, or not counted)
    loop_elements: int  # elements each thread handles per iteration of that loop
    vec: int = 1  # elements per vector the launcher declared (softmax), 1 otherwise
    problems: list[str] = field(default_factory=list)

    @property
    def sass_per_element(self) -> float | None:
        """SASS instructions per element and iteration of the longest loop."""
        return self.loop_sass / self.loop_elements if self.loop_sass else None


def _shape(s: dict[str, int]) -> str:
    return " ".join(f"{k}={v}" for k, v in s.items() if k != "d")


def _meta(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device="meta")


def _softmax_case(op: str, rows: tuple[int, ...], m: int, dtype: str, bench: bool) -> Case:
    from attnscore.kernels import _triton_softmax as S

    def build() -> Launch:
        x = _meta(*rows, m, dtype=DTYPES[dtype])
        lengths = _meta(*rows, dtype=torch.int64)
        if op == "softmax_fwd":
            return S.fwd_launch(x, lengths, torch.empty_like(x))
        return S.bwd_launch(x, x, lengths, torch.empty_like(x))

    label = " ".join(f"{k}={v}" for k, v in zip("Bn", rows, strict=False)) + f" m={m}"
    return Case(op, label, dtype, "", bench, build)


def _additive_case(op: str, s: dict[str, int], dtype: str, tanh: str, bench: bool) -> Case:
    from attnscore.kernels import _triton_additive as A

    def build() -> Launch:
        dt = DTYPES[dtype]
        B, n, m, h = s["B"], s["n"], s["m"], s["h"]
        qh, kh, w_v = _meta(B, n, h, dtype=dt), _meta(B, m, h, dtype=dt), _meta(h, dtype=dt)
        lengths = _meta(B, n, dtype=torch.int64)
        approx = tanh == "approx"
        if op == "additive_fwd":
            return A.fwd_launch(qh, kh, w_v, lengths, _meta(B, n, m, dtype=dt), approx=approx)
        return A.bwd_launch(_meta(B, n, m, dtype=dt), qh, kh, w_v, lengths, approx=approx)[0]

    return Case(op, _shape(s), dtype, tanh, bench, build)


def cases() -> list[Case]:
    """Every launch the report compiles: each kernel in each dtype at least once.

    Benchmark shapes, as ``attnscore bench --device cuda`` runs them: the masked softmax at
    (64, 256, 1024) in float32 and bfloat16 and at the additive shapes in float32 (additive
    attention calls it on its scores); the additive scores at both additive shapes in
    float32 with the exact and the hardware tanh (every autotune candidate at the large
    one). Odd shapes: n=100, m=300, h=100 (softmax rows of 300 in float16 and float64, the
    additive kernels in all four dtypes with each dtype's default tanh) and softmax rows
    of 16384 (the looping kernels) in all four dtypes.
    """

    def default_tanh(dt: str) -> str:
        return "approx" if hardware_tanh(DTYPES[dt], mode="auto") else "exact"

    out: list[Case] = []
    for op in ("softmax_fwd", "softmax_bwd"):
        rows = (SOFTMAX["B"], SOFTMAX["n"])
        out += [_softmax_case(op, rows, SOFTMAX["m"], dt, True) for dt in ("float32", "bfloat16")]
        for s in (ADDITIVE_SMALL, ADDITIVE_LARGE):
            out.append(_softmax_case(op, (s["B"], s["n"]), s["m"], "float32", True))
        for dt in ("float16", "float64"):
            out.append(_softmax_case(op, (ODD["B"], ODD["n"]), ODD["m"], dt, False))
        for dt in DTYPES:
            out.append(_softmax_case(op, (LONG_ROWS["B"], LONG_ROWS["n"]), 16384, dt, False))
    for op in ("additive_fwd", "additive_bwd"):
        for s in (ADDITIVE_SMALL, ADDITIVE_LARGE):
            out += [_additive_case(op, s, "float32", tanh, True) for tanh in ("exact", "approx")]
        out += [_additive_case(op, ODD, dt, default_tanh(dt), False) for dt in DTYPES]
    return out


# ------------------------------------------------------------------------ compiling


class _Driver:
    """A stand-in for Triton's CUDA driver: says which GPU to compile for, nothing else.

    ``get_current_device`` returns the architecture, so that each architecture gets its own
    per-device kernel cache inside Triton."""

    def __init__(self, arch: int) -> None:
        self.arch = arch

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", self.arch, 32)


@contextmanager
def _target(arch: int) -> Iterator[None]:
    from triton.runtime.driver import driver

    previous = driver._active
    driver.set_active(_Driver(arch))
    try:
        yield
    finally:
        driver._active = previous


def unavailable() -> str | None:
    """Why kernels cannot be compiled here (None when they can): triton missing, an
    interpreting triton, or no NVIDIA backend, ptxas or cuobjdump."""
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        return "TRITON_INTERPRET is set: an interpreting Triton does not compile (unset it)"
    try:
        import triton.knobs
        from triton.backends import backends
    except ImportError as exc:
        return f"triton is not importable ({exc})"
    if "nvidia" not in backends:
        return f"this Triton has no NVIDIA backend (backends: {sorted(backends)})"
    for tool in ("ptxas", "ptxas_blackwell", "cuobjdump"):
        path = getattr(triton.knobs.nvidia, tool).path
        if not path or not os.path.exists(path):
            return f"this Triton has no bundled {tool}"
    return None


def _tool(name: str) -> str:
    import triton.knobs

    return str(getattr(triton.knobs.nvidia, name).path)


def _ptxas_log(ptx: str, arch: int) -> str:
    """``ptxas -v`` on the PTX, with the ptxas and the options Triton uses for ``arch``
    (for kernels that came from Triton's cache, whose ptxas log is gone)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [get_ptxas(arch).path, "-v", "--regAllocOptLevel=2"]
        cmd += [f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", src + ".o"]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stderr


def parse_ptxas_log(log: str) -> dict[str, int]:
    """``ptxas -v`` output of one kernel -> regs, spill_stores, spill_loads, stack, smem.

    Raises:
        ValueError: the log has no ``Used N registers`` line.
    """
    regs = re.search(r"Used (\d+) registers", log)
    if regs is None:
        raise ValueError(f"Expected 'Used N registers' in the ptxas log, but got {log!r}")

    def number(pattern: str) -> int:
        found = re.search(pattern, log)
        return int(found.group(1)) if found else 0

    return {
        "regs": int(regs.group(1)),
        "stack": number(r"(\d+) bytes stack frame"),
        "spill_stores": number(r"(\d+) bytes spill stores"),
        "spill_loads": number(r"(\d+) bytes spill loads"),
        "smem": number(r"(\d+) bytes smem"),
    }


def _cuobjdump(cubin: bytes, *options: str) -> str:
    """``cuobjdump`` output for a cubin."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        cmd = [_tool("cuobjdump"), *options, path]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout


def cubin_registers(cubin: bytes) -> int:
    """REG of the cubin's kernel, from ``cuobjdump --dump-resource-usage``.

    Raises:
        ValueError: cuobjdump printed no ``REG:N``.
    """
    out = _cuobjdump(cubin, "--dump-resource-usage")
    found = re.search(r"REG:(\d+)", out)
    if found is None:
        raise ValueError(f"Expected 'REG:N' from cuobjdump, but got {out!r}")
    return int(found.group(1))


def longest_loop(sass: str) -> int:
    """Instructions in the longest loop of ``cuobjdump -sass`` output: the longest span
    from a branch target back to a later branch to it (16-byte instructions); 0 without a
    loop."""
    best = 0
    for at, target in re.findall(
        r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?BRA\s+0x([0-9a-f]+)", sass
    ):
        here, there = int(at, 16), int(target, 16)
        if there <= here:
            best = max(best, (here - there) // 16 + 1)
    return best


def ptx_facts(ptx: str) -> dict[str, int]:
    """Counts in PTX text: vector global loads, ``tanh.approx``, float64 instructions,
    warp shuffles and barriers."""
    return {
        "vector_loads": len(re.findall(r"\bld\.global(?:\.\w+)*\.v[248]\.", ptx)),
        "tanh_approx": len(re.findall(r"\btanh\.approx\.", ptx)),
        "f64": len(re.findall(r"^\s*(?:@%p\d+\s+)?\w+(?:\.\w+)*\.f64\b", ptx, re.MULTILINE)),
        "shuffles": len(re.findall(r"\bshfl\.sync\b", ptx)),
        "barriers": len(re.findall(r"\b(?:bar|barrier)\.sync\b", ptx)),
    }


def loop_exchanges(ttgir: str) -> int:
    """Operations inside ``scf.for`` loops of Triton GPU IR that move data between lanes
    or through shared memory: layout conversions, reductions, shared-memory accesses."""
    depth: list[int] = []
    count = 0
    for line in ttgir.splitlines():
        indent = len(line) - len(line.lstrip())
        if depth and line.lstrip().startswith("}") and indent == depth[-1]:
            depth.pop()
        elif "scf.for" in line and line.rstrip().endswith("{"):
            depth.append(indent)
        elif depth and re.search(r"ttg\.convert_layout|\"tt\.reduce\"|ttg\.local_", line):
            count += 1
    return count


def _loop_elements(meta: dict[str, Any], threads: int) -> int:
    """Elements one thread handles per iteration of the kernel's main loop (0: the kernel
    has none, as the one-block softmax kernels)."""
    if "BI" in meta:
        return max(1, int(meta["BI"]) * int(meta["BJ"]) // threads)
    return 0 if "ROWS" in meta else max(1, int(meta["BLOCK_M"]) // threads)


def _config_label(meta: dict[str, Any]) -> str:
    keys = ("BI", "BJ", "ROWS", "BLOCK_M", "VEC")
    parts = [f"{k}={meta[k]}" for k in keys if k in meta]
    return " ".join([*parts, f"warps={meta.get('num_warps', 4)}"])


def _compile(launch: Launch, meta: dict[str, Any]) -> tuple[Any, str | None]:
    """Compile one variant of a launch for the current target; also return the ptxas log
    when ptxas ran (None when Triton took the kernel from its cache)."""
    import triton.knobs

    kernel = launch.kernel.fn if launch.configs else launch.kernel
    log = io.StringIO()
    saved = triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True  # Triton prints it to stdout
    try:
        with redirect_stdout(log):
            compiled = kernel.warmup(*launch.args, grid=launch.grid(meta), **meta)
    finally:
        triton.knobs.nvidia.dump_ptxas_log = saved
    return compiled, log.getvalue() or None


def compile_case(case: Case, arch: int, *, sass: bool = False) -> list[Result]:
    """Compile one case for one architecture (every autotune candidate) and check it;
    ``sass``: also disassemble to count the instructions of the main loop (slow)."""
    out = []
    with _target(arch):
        launch = case.build()
        for meta in launch.variants():
            compiled, log = _compile(launch, meta)
            ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
            res = parse_ptxas_log(log or _ptxas_log(ptx, arch))
            threads = 32 * compiled.metadata.num_warps
            elements = _loop_elements(meta, threads)
            facts = ptx_facts(ptx)
            result = Result(
                case.op, case.shape, case.dtype, case.tanh, case.bench,
                kernel=launch.name, config=_config_label(meta), arch=arch,
                grid=launch.grid(meta)[0], threads=threads, regs=res["regs"],
                spill_stores=res["spill_stores"], spill_loads=res["spill_loads"],
                stack=res["stack"], smem=res["smem"] + compiled.metadata.shared,
                cubin_bytes=len(cubin), cuobjdump_regs=cubin_registers(cubin),
                loop_exchanges=loop_exchanges(compiled.asm["ttgir"]),
                loop_sass=longest_loop(_cuobjdump(cubin, "-sass")) if sass and elements else 0,
                loop_elements=elements, vec=int(meta.get("VEC", 1)),
                vector_loads=facts["vector_loads"], tanh_approx=facts["tanh_approx"],
                f64=facts["f64"], shuffles=facts["shuffles"], barriers=facts["barriers"],
            )  # fmt: skip
            result.problems = check(result)
            out.append(result)
    return out


def check(r: Result) -> list[str]:
    """What is wrong with a compiled kernel (empty when nothing is): the issue-17 rules."""
    problems = []
    if r.cubin_bytes == 0:
        problems.append("no cubin")
    if r.dtype != "float64" and (r.spill_stores or r.spill_loads):
        problems.append(f"spills {r.spill_stores} B stored, {r.spill_loads} B loaded")
    if r.regs > 255 or r.regs * r.threads > REGS_PER_SM:
        problems.append(f"{r.regs} registers x {r.threads} threads do not fit an SM")
    if r.cuobjdump_regs != r.regs:
        problems.append(f"cuobjdump says {r.cuobjdump_regs} registers, ptxas {r.regs}")
    if r.smem > ARCHS[r.arch]:
        problems.append(f"{r.smem} B of shared memory > {ARCHS[r.arch]} B")
    if r.tanh == "approx" and not r.tanh_approx:
        problems.append("hardware tanh requested but no tanh.approx in the PTX")
    if r.tanh != "approx" and r.tanh_approx:
        problems.append("tanh.approx in the PTX of an exact-tanh kernel")
    if r.dtype != "float64" and r.f64:
        problems.append(f"{r.f64} float64 instructions in {r.dtype} PTX")
    if r.op == "additive_fwd" and r.loop_exchanges:
        problems.append(f"{r.loop_exchanges} exchanges between lanes in the forward's loop")
    if r.vec > 1 and not r.vector_loads:
        problems.append(f"VEC={r.vec} declared but no vector load in the PTX")
    if r.bench and r.grid < MIN_PROGRAMS:
        problems.append(f"grid of {r.grid} programs < {MIN_PROGRAMS} at a benchmark shape")
    return problems


def report(
    archs: Sequence[int] = tuple(ARCHS),
    only: Sequence[Case] | None = None,
    *,
    sass: bool = False,
    jobs: int = 1,
) -> list[Result]:
    """Compile every case of :func:`cases` (or ``only``) for each architecture.

    Args:
        archs: compute capabilities, keys of ``ARCHS``.
        only: the cases to compile (default: all of :func:`cases`).
        sass: count the SASS instructions of each main loop (0.4 s more per kernel).
        jobs: with 2 or more, the last architecture is compiled at the same time in a
            second process (this script again; ``only`` must be None).

    Raises:
        RuntimeError: :func:`unavailable` gives a reason, or the second process failed.
    """
    reason = unavailable()
    if reason is not None:
        raise RuntimeError(f"Cannot compile Triton kernels here: {reason}")
    archs = list(archs)
    todo = cases() if only is None else only
    if jobs < 2 or len(archs) < 2 or only is not None:
        return [r for case in todo for a in archs for r in compile_case(case, a, sass=sass)]
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = [sys.executable, os.path.abspath(__file__), "--json", path, "--jobs", "1"]
    cmd += ["--arch", str(archs.pop()), *(["--sass"] if sass else [])]
    child = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    try:
        results = [r for case in todo for a in archs for r in compile_case(case, a, sass=sass)]
        code = child.wait()
        with open(path) as f:
            text = f.read()
    finally:
        child.kill()  # a no-op once it has exited
        child.wait()
        os.remove(path)
    data = json.loads(text) if text else {}
    if "results" not in data:
        raise RuntimeError(f"The second compile process failed (exit code {code}): {data}")
    return results + [result_from_dict(d) for d in data["results"]]


def result_from_dict(d: dict[str, Any]) -> Result:
    """A :class:`Result` from its JSON form (``dataclasses.asdict``)."""
    return Result(**d)


# ------------------------------------------------------------------------ output


def _triton_version() -> str:
    import triton

    return str(triton.__version__)


def markdown(results: Sequence[Result], triton_version: str) -> str:
    """The report as a Markdown table: one row per (op, shape, dtype, tanh, configuration),
    sm_80 and sm_90 side by side; ``triton_version`` goes into the caption."""
    rows: dict[tuple[str, ...], dict[int, Result]] = {}
    for r in results:
        rows.setdefault((r.op, r.shape, r.dtype, r.tanh, r.config), {})[r.arch] = r
    archs = sorted({r.arch for r in results})
    head = ["op", "shape", "dtype", "tanh", "configuration", "grid"]
    head += [f"sm_{a} regs / spill B / smem B" for a in archs]
    head += ["loop exchanges", "loop SASS / element"]
    head += ["vector loads", "tanh.approx", "shfl", "bar", "checks"]
    lines = [
        f"Triton {triton_version}, {len(results)} compiles; spill B = spill stores + "
        "loads; counts of vector loads, tanh.approx, shuffles and barriers in the "
        f"sm_{archs[-1]} PTX; * = benchmark shape (grid >= {MIN_PROGRAMS}).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for key, by_arch in rows.items():
        op, shape, dtype, tanh, config = key
        last = by_arch[archs[-1]]
        cells = [op, shape + (" *" if last.bench else ""), dtype, tanh or "-", config]
        cells.append(str(last.grid))
        for a in archs:
            r = by_arch[a]
            cells.append(f"{r.regs} / {r.spill_stores + r.spill_loads} / {r.smem}")
        cells.append(str(last.loop_exchanges))
        per = last.sass_per_element
        cells.append("-" if per is None else f"{per:.1f}")
        cells += [str(last.vector_loads), str(last.tanh_approx), str(last.shuffles)]
        cells.append(str(last.barriers))
        problems = sorted({p for r in by_arch.values() for p in r.problems})
        cells.append("; ".join(problems) or "ok")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _line(r: Result) -> str:
    head = f"{r.op} {r.shape} {r.dtype} {r.tanh or '-'} [{r.config}] sm_{r.arch}:"
    body = f"regs {r.regs}, spill {r.spill_stores + r.spill_loads} B, smem {r.smem} B, "
    return f"{head} {body}grid {r.grid}: " + ("; ".join(r.problems) or "ok")


def main(argv: Sequence[str] | None = None) -> int:
    """``python tools/triton_aot.py``: compile, print, exit 1 on a failed check
    (2 when kernels cannot be compiled here)."""
    parser = argparse.ArgumentParser(
        prog="python tools/triton_aot.py",
        description="Compile every Triton kernel for sm_80 and sm_90 without a GPU and "
        "check registers, spills, shared memory, grid sizes and the PTX (issue 17).",
    )
    parser.add_argument("--markdown", action="store_true", help="print the Markdown table")
    parser.add_argument("--json", metavar="PATH", help="also write every result as JSON")
    parser.add_argument("--arch", type=int, nargs="+", choices=sorted(ARCHS), default=list(ARCHS))
    parser.add_argument("--sass", action="store_true", help="count main-loop SASS (slower)")
    parser.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    args = parser.parse_args(argv)
    # Triton 3.9's default, set as the test suite sets it: without it Triton warns that
    # 3.10 turns FP fusion off (the documented table was compiled with fusion on).
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    reason = unavailable()
    if reason is not None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"unavailable": reason}, f)
        print(f"cannot compile here: {reason}", file=sys.stderr)
        return 2
    results = report(args.arch, sass=args.sass, jobs=args.jobs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"triton": _triton_version(), "results": [asdict(r) for r in results]}, f)
    if args.markdown:
        print(markdown(results, _triton_version()), end="")
    else:
        print("\n".join(_line(r) for r in results))
    return 1 if any(r.problems for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
