"""The GPU measurements that ``attnscore bench`` does not make (tools/gpu_check.sh runs this).

Sections (``--only`` picks some; all by default), written as one JSON file:

- ``env``: GPU, torch, CUDA and Triton versions, multiprocessors, L2.
- ``copy``: the bandwidth a plain ``copy_`` reaches (bytes read + written / time): the
  ceiling the masked softmax is held against.
- ``softmax``: ``attnscore.masked_softmax`` forward, bytes read + written over time, as a
  fraction of ``copy`` and of a ``copy_`` of the same tensor; ``torch.softmax`` and the
  library's kernel launched alone (no checks, no Python above the launch) beside it.
- ``overhead``: where a DotProductAttention call by lengths spends its time (profiler).
- ``varlen``: dot-product attention by key lengths on flash attention's variable-length
  kernel (kernels/_varlen.py) against SDPA with the key mask (a user's call, and the
  library's SDPA route), over shapes, dtypes and lengths, with and without causal masking,
  forward and forward + backward; first its error against float64.
- ``additive``: AdditiveAttention forward + backward against the textbook module (time and
  ``max_memory_allocated`` above the inputs).
- ``launches``: the masked softmax kernel launched alone at each (rows per program, warps)
  for rows of 128 to 4096 keys, float32 and bfloat16, as a fraction of a ``copy_`` of the
  same tensor: the data behind ``_triton_softmax._warps``.
- ``host``: the host's share of the bench's dot row, (32, 1024, 1024, 64) bfloat16 with one
  head: for SDPA and for attnscore's module and function, with no mask, causal masking and
  key lengths, the PyTorch ops one call dispatches, the host time to issue it, and the time
  per call of 50 calls in a row (the larger of host and GPU time).
- ``masks``: the GPU time of ``DotProductAttention`` on the routes that go to SDPA with a
  mask (float32 by lengths (B,), bfloat16 by a boolean mask and by lengths (B, n)) against
  SDPA with the same mask built beforehand: ``torch.profiler`` over 10 forward calls at
  the bench's dot row, with each one's table of ops.
- ``floor``: the kernels alone at the headline shape, (32, 8, 1024, 1024, 64) bfloat16,
  lengths (B,) uniform in [1, m]: flash attention's and the efficient kernel's
  variable-length forms on the padded layout (no library code), SDPA dense and with the
  key mask, and attnscore's call; forward + backward by ``torch.autograd.grad``.

``--render`` also shows the ``flex`` and ``flex_compile`` sections of runs 1 and 2, which
measured ``flex_attention`` by lengths (since removed from the library).

Times: ``triton.testing.do_bench`` medians (CUDA events, warm-up first) in milliseconds.
Usage: ``python tools/gpu_measure.py --out measure.json [--only varlen additive]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _bench(fn: Callable[[], Any]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))


def env() -> dict[str, Any]:
    import triton

    p = torch.cuda.get_device_properties(0)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "multiprocessors": p.multi_processor_count,
        "l2_mib": getattr(p, "L2_cache_size", 0) / 2**20,
        "memory_gib": p.total_memory / 2**30,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "python": sys.version.split()[0],
    }


def copy_bandwidth() -> dict[str, Any]:
    x = torch.randn(256 * 2**20, device="cuda")  # 1 GiB
    y = torch.empty_like(x)
    ms = _bench(lambda: y.copy_(x))
    return {"bytes": 2 * x.numel() * 4, "ms": ms, "gb_s": 2 * x.numel() * 4 / ms / 1e6}


def softmax(copy_gb_s: float) -> list[dict[str, Any]]:
    import attnscore
    from attnscore.kernels import _triton_softmax

    rows = []
    B, n, m = 64, 1024, 1024
    for dtype_name in ("float32", "bfloat16"):
        dtype = DTYPES[dtype_name]
        x = torch.randn(B, n, m, device="cuda", dtype=dtype)
        y = torch.empty_like(x)
        full = torch.full((B, n), m, device="cuda")
        uniform = torch.randint(1, m + 1, (B, n), device="cuda")
        nbytes = 2 * x.numel() * x.element_size()
        same = nbytes / _bench(partial(y.copy_, x)) / 1e6
        for name, fn in (
            ("attnscore, every length m", partial(attnscore.masked_softmax, x, full)),
            ("attnscore, lengths uniform in [1, m]", partial(attnscore.masked_softmax, x, uniform)),
            ("its kernel alone, every length m", _triton_softmax.fwd_launch(x, full, y).run),
            ("torch.softmax", partial(torch.softmax, x, -1)),
        ):
            with torch.no_grad():
                ms = _bench(fn)
            gb_s = nbytes / ms / 1e6
            rows.append(
                {
                    "dtype": dtype_name,
                    "shape": [B, n, m],
                    "impl": name,
                    "ms": ms,
                    "gb_s": gb_s,
                    "of_copy": gb_s / copy_gb_s,
                    "of_copy_same": gb_s / same,
                }
            )
        del x, y
    return rows


VARLEN_SHAPES = [  # (B, H, n, m, d)
    (32, 8, 1024, 1024, 64),
    (32, 1, 1024, 1024, 64),
    (16, 16, 1024, 1024, 128),
    (64, 8, 256, 256, 64),
    (32, 8, 512, 512, 64),
    (64, 8, 128, 128, 64),
    (128, 4, 32, 32, 64),
    (8, 8, 4096, 4096, 64),
    (2, 16, 8192, 8192, 64),
]


def _varlen_error(dtype: torch.dtype, causal: bool) -> dict[str, Any]:
    """attnscore.dot_product_attention on flash_varlen against float64: output and
    gradients, with NaN in the padding and lengths 0 and m among the examples."""
    import attnscore
    from attnscore import kernels

    gen = torch.Generator().manual_seed(2)
    B, H, n, m, d = 4, 4, 300, 517, 64
    q, k, v = (torch.randn(B, H, s, d, generator=gen, dtype=torch.float64) for s in (n, m, m))
    L = torch.randint(1, m + 1, (B,), generator=gen)
    L[0], L[1] = 0, m
    padded = (torch.arange(m) >= L.view(B, 1, 1)).unsqueeze(-1)
    ins = [t.cuda().to(dtype) for t in (q, k, v)]
    ins[1].masked_fill_(padded.cuda(), math.nan)
    ins[2].masked_fill_(padded.cuda(), math.nan)
    ins = [t.requires_grad_() for t in ins]
    every = {(dtype, training): 1 for training in (False, True)}
    with (
        kernels.use("flash_varlen"),
        kernels.thresholds(varlen_min_keys=every, varlen_causal_min_keys=every),
    ):
        out = attnscore.dot_product_attention(*ins, L.cuda(), causal=causal)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    (out.double() * g.cuda()).sum().backward()
    ref_ins = [t.clone().requires_grad_() for t in (q, k, v)]
    allowed = torch.arange(m) < L.view(B, 1, 1, 1)
    if causal:
        allowed = allowed & torch.ones(n, m, dtype=torch.bool).tril()
    s = ref_ins[0] @ ref_ins[1].mT * d**-0.5
    ref = torch.softmax(s.masked_fill(~allowed, -math.inf), -1).nan_to_num(0.0) @ ref_ins[2]
    (ref * g).sum().backward()

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double().cpu() - b).norm() / b.norm().clamp_min(1e-30))

    grads = [t.grad for t in ins]
    return {
        "out": rel(out.detach(), ref.detach()),
        **{f"grad_{x}": rel(t, r.grad) for x, t, r in zip("qkv", grads, ref_ins, strict=True)},
        "idle_rows_zero": bool((out[0] == 0).all()),
        "padded_keys_zero_grad": bool((grads[1].cpu()[padded.expand(B, H, m, d)] == 0).all()),
        "finite": all(bool(torch.isfinite(t).all()) for t in (out, *grads)),
    }


def varlen(shapes: list[tuple[int, ...]], dtypes: list[str]) -> dict[str, Any]:
    """Dot-product attention by key lengths (one per example) on the variable-length flash
    kernel (kernels/_varlen.py) against SDPA with the key mask, a user's call and
    attnscore's SDPA route, through the public function (host time included): lengths
    uniform in [1, m], every length m (nothing to skip), and uniform with causal masking."""
    import attnscore
    from attnscore import kernels

    # flash_varlen at every size, whatever the thresholds (which these rows justify)
    every = {(DTYPES[d], training): 1 for d in dtypes for training in (False, True)}
    everywhere = {"varlen_min_keys": every, "varlen_causal_min_keys": every}
    errors = {
        f"{d}{', causal' if causal else ''}": _varlen_error(DTYPES[d], causal)
        for d in dtypes
        if d != "float32"
        for causal in (False, True)
    }
    print(json.dumps(errors), flush=True)
    rows = []
    gen = torch.Generator().manual_seed(0)
    for B, H, n, m, d in shapes:
        for dtype_name in dtypes:
            if dtype_name == "float32":
                continue
            dtype = DTYPES[dtype_name]
            q, k, v = (torch.randn(B, H, s, d, device="cuda", dtype=dtype) for s in (n, m, m))
            for kind in ("uniform", "full", "causal + uniform"):
                if kind == "full":
                    L = torch.full((B,), m, device="cuda")
                else:
                    L = torch.randint(1, m + 1, (B,), generator=gen).cuda()
                causal = kind.startswith("causal")
                key_mask = (torch.arange(m, device="cuda") < L[:, None])[:, None, None, :]
                if causal:
                    key_mask = key_mask & torch.ones(n, m, dtype=torch.bool, device="cuda").tril()

                def user(a: Any, b: Any, c: Any, km: Any = key_mask) -> Any:
                    return F.scaled_dot_product_attention(a, b, c, attn_mask=km)

                def ours(a: Any, b: Any, c: Any, L: Any = L, cz: bool = causal) -> Any:
                    return attnscore.dot_product_attention(a, b, c, L, causal=cz)

                # the route each is timed on (entered around the timing, not in each call)
                impls = {"sdpa_key_mask": user, "attnscore_sdpa": ours, "attnscore_varlen": ours}
                routes = {"attnscore_sdpa": "sdpa", "attnscore_varlen": "flash_varlen"}
                for backward in (False, True):
                    ins = [t.detach().requires_grad_(backward) for t in (q, k, v)]
                    grad = torch.randn(B, H, n, d, device="cuda", dtype=dtype)
                    times: dict[str, Any] = {}
                    for name, fn in impls.items():

                        def step(
                            fn: Callable[..., Any] = fn,
                            ins: list[torch.Tensor] = ins,
                            backward: bool = backward,
                            grad: torch.Tensor = grad,
                        ) -> None:
                            out = fn(*ins)
                            if backward:
                                out.backward(grad)

                        route = routes.get(name)
                        try:
                            with contextlib.ExitStack() as stack, torch.set_grad_enabled(backward):
                                if route is not None:
                                    stack.enter_context(kernels.use(route))
                                    stack.enter_context(kernels.thresholds(**everywhere))
                                step()
                                times[name] = _bench(step)
                        except Exception as err:  # one failing implementation: noted
                            times[name] = None
                            times[name + "_error"] = f"{type(err).__name__}: {err}"[:300]
                    base, new = times.get("sdpa_key_mask"), times.get("attnscore_varlen")
                    rows.append(
                        {
                            "shape": [B, H, n, m, d],
                            "dtype": dtype_name,
                            "lengths": kind,
                            "step": "fwd+bwd" if backward else "fwd",
                            "ms": times,
                            "varlen_over_sdpa": (new / base) if new and base else None,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
            del q, k, v
            torch.cuda.empty_cache()
    return {"errors": errors, "rows": rows}


def overhead() -> dict[str, Any]:
    """Where a DotProductAttention call by lengths spends its time on the GPU: the
    profiler's table (CPU and CUDA time per op) of 20 calls, bfloat16 (32, 1024, 1024, 64)
    forward, next to SDPA with a key mask."""
    import attnscore

    B, n, m, d = 32, 1024, 1024, 64
    q, k, v = (torch.randn(B, s, d, device="cuda", dtype=torch.bfloat16) for s in (n, m, m))
    lens = torch.randint(1, m + 1, (B,), device="cuda")
    module = attnscore.DotProductAttention(0.0).eval()
    mask = (torch.arange(m, device="cuda") < lens[:, None])[:, None, None, :]
    calls = {
        "attnscore": lambda: module(q, k, v, lens),
        "functional": lambda: attnscore.dot_product_attention(q, k, v, lens),
        "sdpa": lambda: F.scaled_dot_product_attention(
            q[:, None], k[:, None], v[:, None], attn_mask=mask
        ),
    }
    out: dict[str, Any] = {}
    with torch.no_grad():
        for name, fn in calls.items():
            fn()
            out[name + "_ms"] = _bench(fn)
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                calls["attnscore"]()
            torch.cuda.synchronize()
    out["profile"] = prof.key_averages().table(sort_by="cpu_time_total", row_limit=40)
    print(out["profile"][:6000], flush=True)
    return out


def additive() -> list[dict[str, Any]]:
    import attnscore
    from attnscore import textbook

    rows = []
    for B, n, m, h, d, dtype_name in (
        (8, 128, 512, 128, 64, "float32"),
        (16, 256, 1024, 128, 64, "float32"),
        (16, 256, 1024, 128, 64, "bfloat16"),
    ):
        dtype = DTYPES[dtype_name]
        torch.manual_seed(0)
        q = torch.randn(B, n, d, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(B, m, d, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(B, m, d, device="cuda", dtype=dtype, requires_grad=True)
        lens = torch.randint(1, m + 1, (B,), device="cuda")
        ours = attnscore.AdditiveAttention(d, d, h, 0.0).to("cuda", dtype)
        book = textbook.AdditiveAttention(d, d, h, 0.0).to("cuda", dtype)
        book.load_state_dict(ours.state_dict(), strict=False)
        grad = torch.randn(B, n, d, device="cuda", dtype=dtype)
        row: dict[str, Any] = {"shape": [B, n, m, h, d], "dtype": dtype_name}
        for name, module in (("attnscore", ours), ("textbook", book)):

            def step(module: Any = module, inputs: tuple[Any, ...] = (q, k, v, lens, grad)) -> None:
                *args, g = inputs
                module(*args).backward(g)

            try:
                step()
                torch.cuda.synchronize()
                before = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                step()
                torch.cuda.synchronize()
                row[f"{name}_peak_mib"] = (torch.cuda.max_memory_allocated() - before) / 2**20
                row[f"{name}_ms"] = _bench(step)
            except Exception as err:
                row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
            q.grad = k.grad = v.grad = None
            module.zero_grad(set_to_none=True)
        if "attnscore_ms" in row and "textbook_ms" in row:
            row["speedup"] = row["textbook_ms"] / row["attnscore_ms"]
            row["peak_ratio"] = row["attnscore_peak_mib"] / row["textbook_peak_mib"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def _softmax_launch(
    x: torch.Tensor, lengths: torch.Tensor, y: torch.Tensor, per: int, warps: int
) -> None:
    """The masked softmax's one-block kernel on rows of x, ``per`` rows per program."""
    import triton
    import triton.language as tl

    from attnscore.kernels import _triton_softmax as ts

    n_rows, m = x.shape
    ts._fwd_block_kernel[(triton.cdiv(n_rows, per),)](
        x, lengths, y, n_rows, m, ROWS=per, BLOCK_M=m, VEC=16 // x.element_size(),
        ACC=tl.float32, num_warps=warps,
    )  # fmt: skip


def launches() -> list[dict[str, Any]]:
    from attnscore.kernels import _triton_softmax as ts

    rows: list[dict[str, Any]] = []
    for dtype_name in ("bfloat16", "float32"):
        dtype = DTYPES[dtype_name]
        for m in (128, 256, 512, 1024, 2048, 4096):
            n_rows = 64 * 1024 * 1024 // m
            x = torch.randn(n_rows, m, device="cuda", dtype=dtype)
            y = torch.empty_like(x)
            full = torch.full((n_rows,), m, device="cuda")
            nbytes = 2 * x.numel() * x.element_size()
            same = nbytes / _bench(partial(y.copy_, x)) / 1e6
            chosen = ts.fwd_launch(x, full, y).meta
            for per in (1, 2, 4, 8, 16):
                for warps in (1, 2, 4, 8):
                    if not 256 <= per * m <= 8192 or warps * 32 * 16 > 2 * per * m * dtype.itemsize:
                        continue
                    ms = _bench(partial(_softmax_launch, x, full, y, per, warps))
                    rows.append(
                        {
                            "dtype": dtype_name,
                            "m": m,
                            "rows_per_program": per,
                            "warps": warps,
                            "chosen": (chosen.get("ROWS"), chosen["num_warps"]) == (per, warps),
                            "ms": ms,
                            "of_copy_same": nbytes / ms / 1e6 / same,
                        }
                    )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def floor() -> dict[str, Any]:
    import attnscore

    B, H, n, m, d = 32, 8, 1024, 1024, 64
    scale = d**-0.5
    lens = torch.randint(1, m + 1, (B,), generator=torch.Generator().manual_seed(0)).cuda()
    q, k, v = (
        torch.randn(B, H, s, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
        for s in (n, m, m)
    )
    grad = torch.randn(B, H, n, d, device="cuda", dtype=torch.bfloat16)
    key_mask = (torch.arange(m, device="cuda") < lens[:, None])[:, None, None, :]
    # the sequences of kernels/_varlen.py, written out: no query over a padded key
    s = torch.arange(2 * B * H + 1, device="cuda", dtype=torch.int32)
    cu_q, cu_k = (s + 1) // 2 * n, s // 2 * m
    cu_k[1::2] += lens.repeat_interleave(H).to(torch.int32)

    def flash() -> Any:
        rows = (t.reshape(-1, 1, d) for t in (q, k, v))
        return torch.ops.aten._flash_attention_forward(
            *rows, cu_q, cu_k, n, m, 0.0, False, False, scale=scale
        )[0]

    def efficient() -> Any:
        rows = (t.reshape(1, -1, 1, d) for t in (q, k, v))
        return torch.ops.aten._efficient_attention_forward(
            *rows, None, cu_q, cu_k, n, m, 0.0, 0, True, scale=scale
        )[0]

    calls = {
        "SDPA + key mask": lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask),
        "SDPA, no mask (all the work)": lambda: F.scaled_dot_product_attention(q, k, v),
        "flash varlen kernel alone": lambda: flash().view(B, H, n, d),
        "efficient varlen kernel alone": lambda: efficient().view(B, H, n, d),
        "attnscore.dot_product_attention": lambda: attnscore.dot_product_attention(q, k, v, lens),
    }
    out: dict[str, Any] = {}

    def step(fn: Callable[[], Any]) -> Any:
        return torch.autograd.grad(fn(), (q, k, v), grad)

    for name, fn in calls.items():
        row = {"fwd": _bench(fn), "fwd+bwd": _bench(partial(step, fn))}
        with torch.no_grad():
            row["fwd, no grad"] = _bench(fn)
        out[name] = row
        print(name, json.dumps(row), flush=True)
    return out


def _aten_ops(fn: Callable[[], Any]) -> int:
    """How many PyTorch ops one call of ``fn`` dispatches (each costs the host a few us)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            Count.ops += 1
            return func(*args, **(kwargs or {}))

    with Count():
        fn()
    return Count.ops


def host() -> list[dict[str, Any]]:
    import attnscore

    B, n, m, d = 32, 1024, 1024, 64
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, s, d, generator=g).to("cuda", torch.bfloat16) for s in (n, m, m))
    lens = torch.randint(1, m + 1, (B,), generator=g).cuda()
    key_mask = (torch.arange(m, device="cuda") < lens[:, None])[:, None, None, :]
    module = attnscore.DotProductAttention(0.0).eval()
    calls = {
        ("none", "SDPA"): lambda: _sdpa4(q, k, v),
        ("none", "DotProductAttention"): lambda: module(q, k, v),
        ("none", "dot_product_attention"): lambda: attnscore.dot_product_attention(q, k, v),
        ("causal", "SDPA"): lambda: _sdpa4(q, k, v, is_causal=True),
        ("causal", "DotProductAttention"): lambda: module(q, k, v, causal=True),
        ("causal", "dot_product_attention"): lambda: attnscore.dot_product_attention(
            q, k, v, causal=True
        ),
        ("lengths (B,)", "SDPA + key mask"): lambda: _sdpa4(q, k, v, attn_mask=key_mask),
        ("lengths (B,)", "DotProductAttention"): lambda: module(q, k, v, lens),
        ("lengths (B,)", "dot_product_attention"): lambda: attnscore.dot_product_attention(
            q, k, v, lens
        ),
    }
    rows = []
    with torch.no_grad():
        for (mask, name), fn in calls.items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            ops = _aten_ops(fn)
            hosts, walls = [], []
            for _ in range(5):
                torch.cuda.synchronize()
                start = time.perf_counter()
                for _ in range(50):
                    fn()
                issued = time.perf_counter()
                torch.cuda.synchronize()
                hosts.append((issued - start) / 50 * 1e3)
                walls.append((time.perf_counter() - start) / 50 * 1e3)
            row = {"mask": mask, "call": name, "aten_ops": ops, "host_ms": min(hosts)}
            row.update(wall_ms=min(walls), gpu_ms=_bench(fn))
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def masks() -> list[dict[str, Any]]:
    from torch.profiler import ProfilerActivity, profile

    import attnscore

    B, n, m, d = 32, 1024, 1024, 64
    g = torch.Generator().manual_seed(0)
    module = attnscore.DotProductAttention(0.0).eval()
    rows = []
    for dtype, kind in (
        ("float32", "lengths (B,)"),
        ("bfloat16", "bool"),
        ("bfloat16", "lengths (B, n)"),
    ):
        q, k, v = (torch.randn(B, s, d, generator=g).to("cuda", DTYPES[dtype]) for s in (n, m, m))
        if kind == "bool":
            allowed = (torch.rand(B, n, m, generator=g) > 0.3).cuda()
            ours: Callable[[], Any] = partial(module, q, k, v, attend_mask=allowed)
            mask = allowed[:, None]
        else:
            lens = torch.randint(1, m + 1, (B,) if kind == "lengths (B,)" else (B, n), generator=g)
            lens = lens.cuda()
            ours = partial(module, q, k, v, lens)
            mask = (torch.arange(m, device="cuda") < lens[..., None]).view(B, 1, -1, m)
        calls = {"attnscore": ours, "SDPA + mask": partial(_sdpa4, q, k, v, attn_mask=mask)}
        with torch.no_grad():
            for name, fn in calls.items():
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    for _ in range(10):
                        fn()
                    torch.cuda.synchronize()
                events = prof.key_averages()
                gpu_us = sum(e.self_device_time_total for e in events) / 10
                table = events.table(sort_by="cuda_time_total", row_limit=14)
                row = {"dtype": dtype, "mask": kind, "call": name, "gpu_ms": gpu_us / 1e3}
                print(json.dumps(row), flush=True)
                rows.append({**row, "table": table})
    return rows


def _sdpa4(q: Any, k: Any, v: Any, **options: Any) -> Any:
    """SDPA of (B, n, d) inputs in the 4-D layout its fused kernels take (3-D goes to its
    math path on CUDA)."""
    return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], **options)


# The profile (``overhead``) runs last: sections run after it in the same process timed the
# library's calls slower than the same calls alone (docs/benchmarks.md, the H100 session).
SECTIONS = [
    "copy",
    "softmax",
    "varlen",
    "additive",
    "launches",
    "floor",
    "host",
    "masks",
    "overhead",
]


def _f(x: Any, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _route_tables(
    part: dict[str, Any],
    names: tuple[str, str, str],
    ratio: tuple[str, str],
    routes: list[tuple[str, str]],
    flags: list[tuple[str, str]],
) -> list[str]:
    """The tables of a section that timed routes of attention by lengths (``varlen``; runs 1
    and 2: ``flex``): ms per route, then the errors against float64. ``names``: the rows'
    kind key, the errors' first heading, the route the errors are of; ``ratio``, ``routes``
    and ``flags``: (heading, key) of the ratio, of the timed routes and of the errors'
    yes/no columns."""
    kind, first, route = names
    heads = " | ".join(head for head, _ in routes)
    lines = [
        f"| (B, H, n, m, d) | dtype | {kind} | step | {heads} | {ratio[0]} |",
        "|---|---|---|---|" + "---|" * (len(routes) + 1),
    ]
    for r in part["rows"]:
        times = " | ".join(_f(r["ms"].get(key)) for _, key in routes)
        lines.append(
            f"| {tuple(r['shape'])} | {r['dtype']} | {r[kind]} | {r['step']} | {times} | "
            f"{_f(r[ratio[1]], 2)} |"
        )
    lines += ["", f"{route} against float64 (relative Frobenius error):", ""]
    lines += [
        f"| {first} | output | grad q | grad k | grad v | "
        + " | ".join(head for head, _ in flags) + " |",
        "|---|---|---|---|---|" + "---|" * len(flags),
    ]  # fmt: skip
    for name, err in part["errors"].items():
        grads = " | ".join(f"{err[key]:.1e}" for key in ("out", "grad_q", "grad_k", "grad_v"))
        lines.append(f"| {name} | {grads} | " + " | ".join(str(err[k]) for _, k in flags) + " |")
    lines.append("")
    return lines


def render(result: dict[str, Any]) -> str:
    """Markdown tables of a measure.json (``--render``)."""
    e = result["env"]
    lines = [
        f"{e['gpu']} ({e['multiprocessors']} SMs, {e['l2_mib']:.0f} MiB L2), torch {e['torch']}, "
        f"CUDA {e['cuda']}, Triton {e['triton']}, Python {e['python']}; medians of "
        "triton.testing.do_bench (ms).",
        "",
    ]
    if "copy" in result:
        c = result["copy"]
        lines += [f"`copy_` of 1 GiB: {c['ms']:.3f} ms, {c['gb_s']:.0f} GB/s (read + written).", ""]
    if "softmax" in result:
        same = any("of_copy_same" in r for r in result["softmax"])
        lines += [
            "| masked softmax forward (64, 1024, 1024) | dtype | ms | GB/s | of copy_ |"
            + (" of copy_ of the same tensor |" if same else ""),
            "|---|---|---|---|---|" + ("---|" if same else ""),
        ]
        for r in result["softmax"]:
            lines.append(
                f"| {r['impl']} | {r['dtype']} | {r['ms']:.3f} | {r['gb_s']:.0f} | "
                f"{r['of_copy']:.2f} |" + (f" {_f(r.get('of_copy_same'), 2)} |" if same else "")
            )
        lines.append("")
    if "overhead" in result:
        o = result["overhead"]
        lines += [
            "One call, bfloat16 (B, n, m, d) = (32, 1024, 1024, 64), lengths (B,), forward: "
            f"DotProductAttention {o['attnscore_ms']:.3f} ms, "
            f"attnscore.dot_product_attention {o['functional_ms']:.3f} ms, SDPA with the key "
            f"mask {o['sdpa_ms']:.3f} ms.",
            "",
        ]
    if "varlen" in result:
        lines += _route_tables(
            result["varlen"],
            ("lengths", "dtype", "flash_varlen"),
            ("flash_varlen / SDPA", "varlen_over_sdpa"),
            [("SDPA + key mask", "sdpa_key_mask"), ("attnscore, sdpa", "attnscore_sdpa"),
             ("attnscore, flash_varlen", "attnscore_varlen")],
            [("zero rows", "idle_rows_zero"), ("padded keys' grads 0", "padded_keys_zero_grad")],
        )  # fmt: skip
    if "flex" in result:  # runs 1 and 2
        lines += _route_tables(
            result["flex"],
            ("mask", "dtype, mask", "flex_attention"),
            ("flex / SDPA", "flex_over_sdpa"),
            [("SDPA + bool mask", "sdpa_bool_mask"), ("attnscore's SDPA route", "attnscore_sdpa"),
             ("flex_attention", "flex")],
            [("idle rows zero", "idle_rows_zero")],
        )  # fmt: skip
    if "flex_compile" in result:
        lines += ["| flex at (16, 16, 1024, 1024, 64) bfloat16 forward | ms |", "|---|---|"]
        for name, value in result["flex_compile"].items():
            if name != "dynamo_counters":
                lines.append(f"| {name} | {value if isinstance(value, str) else _f(value)} |")
        lines += ["", f"dynamo counters: {result['flex_compile'].get('dynamo_counters')}", ""]
    if "floor" in result:
        base = result["floor"]["SDPA + key mask"]
        lines += [
            "| (32, 8, 1024, 1024, 64) bfloat16, lengths (B,) uniform in [1, m] | fwd | "
            "fwd+bwd | fwd+bwd / SDPA + key mask |",
            "|---|---|---|---|",
        ]
        for name, r in result["floor"].items():
            lines.append(
                f"| {name} | {r['fwd']:.3f} | {r['fwd+bwd']:.3f} | "
                f"{r['fwd+bwd'] / base['fwd+bwd']:.2f} |"
            )
        lines.append("")
    if "launches" in result:
        lines += [
            "| masked softmax kernel alone: dtype | m | rows per program | warps | ms | "
            "of copy_ of the same tensor |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["launches"]:
            mark = " (chosen)" if r["chosen"] else ""
            lines.append(
                f"| {r['dtype']} | {r['m']} | {r['rows_per_program']} | {r['warps']}{mark} | "
                f"{r['ms']:.3f} | {r['of_copy_same']:.2f} |"
            )
        lines.append("")
    if "host" in result:
        lines += [
            "| (32, 1024, 1024, 64) bfloat16, forward | call | PyTorch ops per call | host ms "
            "per call | ms per call, 50 in a row | do_bench ms |",
            "|---|---|---|---|---|---|",
        ]
        for r in result["host"]:
            lines.append(
                f"| {r['mask']} | {r['call']} | {r['aten_ops']} | {r['host_ms']:.3f} | "
                f"{r['wall_ms']:.3f} | {r['gpu_ms']:.3f} |"
            )
        lines.append("")
    if "masks" in result:
        lines += [
            "| (32, 1024, 1024, 64), forward | dtype | call | GPU ms per call |",
            "|---|---|---|---|",
        ]
        for r in result["masks"]:
            lines.append(f"| {r['mask']} | {r['dtype']} | {r['call']} | {r['gpu_ms']:.3f} |")
        lines.append("")
    if "additive" in result:
        lines += [
            "| additive fwd + bwd (B, n, m, h, d) | dtype | attnscore ms | textbook ms | "
            "speed-up | attnscore MiB | textbook MiB | memory ratio |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in result["additive"]:
            lines.append(
                f"| {tuple(r['shape'])} | {r['dtype']} | {_f(r.get('attnscore_ms'))} | "
                f"{_f(r.get('textbook_ms'))} | {_f(r.get('speedup'), 2)}x | "
                f"{_f(r.get('attnscore_peak_mib'), 0)} | {_f(r.get('textbook_peak_mib'), 0)} | "
                f"{_f(r.get('peak_ratio'), 3)} |"
            )
    return "\n".join(lines)


def merge_bench(out: str, files: list[str]) -> None:
    """One ``attnscore bench --json`` file of the rows of several (one per row name), for
    ``attnscore bench --from-json``."""
    merged: dict[str, Any] | None = None
    for name in files:
        with open(name) as fh:
            part = json.load(fh)
        if merged is None:
            merged = part
        else:
            merged["rows"].extend(part["rows"])
    if merged is None:
        raise SystemExit("gpu_measure: --merge-bench needs files")
    with open(out, "x") as fh:
        json.dump(merged, fh, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the measurements here (JSON)")
    parser.add_argument("--render", metavar="JSON", help="print a measure.json as tables")
    parser.add_argument(
        "--merge-bench",
        nargs="+",
        metavar=("OUT", "FILE"),
        help="write one bench JSON of the rows of the FILEs (refuses an existing OUT)",
    )
    parser.add_argument("--only", nargs="+", choices=SECTIONS, default=None)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float16", "float32"])
    parser.add_argument(
        "--shapes",
        nargs="+",
        metavar="B,H,n,m,d",
        type=lambda text: tuple(int(x) for x in text.split(",")),
        default=VARLEN_SHAPES,
        help="the varlen section's shapes (default: all of VARLEN_SHAPES)",
    )
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as fh:
            print(render(json.load(fh)))
        return 0
    if args.merge_bench:
        merge_bench(args.merge_bench[0], args.merge_bench[1:])
        return 0
    if not args.out:
        parser.error("--out is required to measure")
    if not torch.cuda.is_available():
        print("gpu_measure: no CUDA GPU", file=sys.stderr)
        return 2
    only = set(args.only or SECTIONS)
    result: dict[str, Any] = {"env": env()}

    def save() -> None:
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)

    save()
    copy_gb_s = None
    for section in SECTIONS:
        if section not in only:
            continue
        started = time.perf_counter()
        try:
            if section == "copy":
                result["copy"] = copy_bandwidth()
                copy_gb_s = result["copy"]["gb_s"]
            elif section == "softmax":
                result["softmax"] = softmax(copy_gb_s or copy_bandwidth()["gb_s"])
            elif section == "varlen":
                result["varlen"] = varlen(args.shapes, args.dtypes)
            elif section == "overhead":
                result["overhead"] = overhead()
            elif section == "launches":
                result["launches"] = launches()
            elif section == "floor":
                result["floor"] = floor()
            elif section == "host":
                result["host"] = host()
            elif section == "masks":
                result["masks"] = masks()
            else:
                result["additive"] = additive()
        except Exception as err:  # later sections still run
            result[section + "_error"] = f"{type(err).__name__}: {err}"[:2000]
        result[section + "_s"] = time.perf_counter() - started
        print(f"== {section}: {result[section + '_s']:.0f} s", file=sys.stderr, flush=True)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
