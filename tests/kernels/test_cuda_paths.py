"""Every path of the path registry (``paths.PATHS``) on a CUDA GPU, against float64 on CPU.

Marked ``cuda``: skipped without a GPU. On a GPU the registered ops dispatch to the CUDA
backend (Triton kernels, SDPA with a mask), so this runs the GPU kernels through every
public way of calling attention: outputs and weights in float32 and bfloat16, lengths per
example and per query with length-0 rows, NaN in padding, and gradients in float32.

``ATTNSCORE_TEST_DEVICE=cpu`` runs the same checks on the CPU (to test this file itself on
a machine without a GPU).
"""

from __future__ import annotations

import os

import pytest
import torch

from paths import PATHS, Path, plain_attention

DEVICE = torch.device(os.environ.get("ATTNSCORE_TEST_DEVICE", "cuda"))
pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU"
    ),
]
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _sizes(path: Path) -> tuple[int, int]:
    return (8, 8) if path.same_feature_size else (8, 6)


def _on_device(runner, device: torch.device):
    """Move the runner's tensors (module or closed-over parameters) to ``device``."""
    if runner.module is not None:
        runner.module.to(device)
    for t in runner.params.values():
        t.data = t.data.to(device)
    return runner


def _case(path: Path, dtype: torch.dtype, per_query: bool, garbage: bool = True):
    qs, ks = _sizes(path)
    gen = torch.Generator().manual_seed(0)
    B, n, m = 3, 5, 70
    q = torch.randn(B, n, qs, generator=gen)
    k = torch.randn(B, m, ks, generator=gen)
    v = torch.randn(B, m, 4, generator=gen)
    lens = (
        torch.tensor([[0, 3, 70, 1, 64], [5, 5, 0, 2, 9], [70, 70, 70, 33, 0]])
        if per_query
        else torch.tensor([0, 17, 70])
    )
    longest = lens.max(dim=-1).values if per_query else lens
    for b in range(B if garbage else 0):  # garbage beyond every length changes nothing
        k[b, int(longest[b]) :] = float("nan")
        v[b, int(longest[b]) :] = float("nan")
    return q.to(dtype), k.to(dtype), v.to(dtype), lens


def _reference(path: Path, runner, q, k, v, lens):
    params = {name: t.detach().double().cpu() for name, t in runner.params.items()}
    return plain_attention(path, params, q.double(), k.double(), v.double(), lens)


@pytest.mark.parametrize("per_query", [False, True], ids=["per-example", "per-query"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", PATHS, ids=str)
def test_path_on_the_device_matches_float64(path, dtype, per_query):
    runner = path.build(*_sizes(path), dtype)
    if runner.module is not None:
        runner.module.eval()
    q, k, v, lens = _case(path, dtype, per_query)
    want_out, want_w = _reference(path, runner, q, k, v, lens)
    runner = _on_device(runner, DEVICE)
    out, weights = runner(q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), lens.to(DEVICE))
    assert out.device.type == DEVICE.type and out.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    tol = TOL[dtype]
    torch.testing.assert_close(out.cpu().double(), want_out, atol=tol, rtol=tol)
    torch.testing.assert_close(weights.cpu().double(), want_w, atol=tol, rtol=tol)
    empty = (lens == 0) if per_query else (lens == 0)[:, None].expand(-1, q.shape[1])
    assert (out.cpu()[empty] == 0).all()  # length 0: exact zeros


@pytest.mark.parametrize("path", PATHS, ids=str)
def test_path_gradients_on_the_device_match_float64(path):
    runner = path.build(*_sizes(path), torch.float32)
    if runner.module is not None:
        runner.module.eval()
    q, k, v, lens = _case(path, torch.float32, per_query=True, garbage=False)
    ref_inputs = [t.double().requires_grad_() for t in (q, k, v)]
    want_out, _ = _reference(path, runner, *ref_inputs, lens)
    grad_out = torch.randn(want_out.shape, generator=torch.Generator().manual_seed(1))
    want = torch.autograd.grad(want_out, ref_inputs, grad_out.double())
    runner = _on_device(runner, DEVICE)
    inputs = [t.to(DEVICE).requires_grad_() for t in (q, k, v)]
    out, _ = runner(*inputs, lens.to(DEVICE))
    got = torch.autograd.grad(out, inputs, grad_out.to(DEVICE))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu().double(), b, atol=1e-4, rtol=1e-4)
