"""On a GPU: the CUDA route of calls by key lengths before flash_varlen against after, side
by side in one process, rounds interleaved (medians of ``triton.testing.do_bench``, ms):
general and cosine (their own pipeline, ``kernels.use("plain")``, against flash_varlen on
their projections) and dot (SDPA with the mask, ``kernels.use("sdpa")``, against
flash_varlen), (B, n, m, d) = (32, 1024, 1024, 64), lengths (B,) uniform in [1, m],
bfloat16 and float16, forward and forward + backward; a user's SDPA with the key mask
beside them. Writes ``$OUT/side.json`` (default: the current folder).

    python tools/gpu_side_by_side.py
"""

import json
import os

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import attnscore
from attnscore import kernels

B, n, m, d = 32, 1024, 1024, 64
rows = []
for dtype in (torch.bfloat16, torch.float16):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, s, d, device="cuda", dtype=dtype, generator=g) for s in (n, m, m))
    lens = torch.randint(1, m + 1, (B,), device="cuda", generator=g)
    key_mask = (torch.arange(m, device="cuda") < lens[:, None])[:, None, None, :]
    for scorer, old in (("general", "plain"), ("cosine", "plain"), ("dot", "sdpa")):
        mod = attnscore.make_scorer(scorer, d, d).to("cuda", dtype)
        for grad in (False, True):
            ins = [t.detach().requires_grad_(grad) for t in (q, k, v)]
            go = torch.randn(B, n, d, device="cuda", dtype=dtype)

            def run(names, ins=ins, grad=grad, go=go, mod=mod, lens=lens):
                with torch.set_grad_enabled(grad):
                    if names is None:
                        out = mod(*ins, lens)
                    else:
                        with kernels.use(names):
                            out = mod(*ins, lens)
                    if grad:
                        out.backward(go)

            def user(ins=ins, grad=grad, go=go, key_mask=key_mask):
                with torch.set_grad_enabled(grad):
                    out = F.scaled_dot_product_attention(
                        *(t[:, None] for t in ins), attn_mask=key_mask
                    )
                    if grad:
                        out.backward(go[:, None])

            times = {"new": [], "old": [], "sdpa_key_mask": []}
            for _ in range(3):  # interleaved rounds
                times["new"].append(do_bench(lambda: run(None), warmup=10, rep=60))
                times["old"].append(do_bench(lambda old=old: run(old), warmup=10, rep=60))
                times["sdpa_key_mask"].append(do_bench(user, warmup=10, rep=60))
            med = {key: sorted(val)[1] for key, val in times.items()}
            row = dict(
                scorer=scorer,
                dtype=str(dtype).split(".")[1],
                step="fwd+bwd" if grad else "fwd",
                old_route=old,
                ms=med,
                new_over_old=med["new"] / med["old"],
            )
            print(json.dumps(row), flush=True)
            rows.append(row)
with open(os.environ.get("OUT", ".") + "/side.json", "w") as f:
    json.dump(rows, f, indent=1)
