"""Old code against new, side by side: the calls a change touches, timed in interleaved
rounds (old, new, new, old, ...), each round in its own process, with PyTorch's own call
timed beside each (the ratio to it corrects for the machine's drift between processes).

Processes, not one: two copies of attnscore cannot share an interpreter (the backend table
names modules by their absolute names), and a C library built before 67123f3 sets FTZ/DAZ
for its whole process when it loads, which would skew the other copy's timings.

    git worktree add /tmp/old f440755
    python tools/ab_compare.py /tmp/old/src src --rounds 3 [CASE SUBSTRINGS ...]

Prints one row per case: the median ms of each, new/old, and each one's ratio to
PyTorch's call where there is one (2 threads, torch.utils.benchmark medians).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def worker(only: list[str]) -> None:
    """Time every case (whose name contains one of ``only``, if given); print JSON."""
    import torch
    import torch.nn.functional as F
    from torch.utils import benchmark

    import attnscore

    torch.set_num_threads(2)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)

    def rn(*s, dt=torch.float32, grad=False):
        return torch.randn(*s, generator=g).to(dt).requires_grad_(grad)

    def lens_b(B, m):
        return torch.randint(1, m + 1, (B,), generator=g)

    def lens_bn(B, n, m):
        return torch.randint(1, m + 1, (B, n), generator=g)

    cases = {}

    def case(name, fn, baseline=None):
        cases[name] = (fn, baseline)

    def fwdbwd(f, *ts):
        def run():
            for t in ts:
                t.grad = None
            f().sum().backward()

        return run

    def nothing_padded(name, q, k, v, module):
        """The cases without a mask and with causal masking alone (``name`` formats the
        mask's word), each against SDPA (``is_causal``)."""
        case(
            name.format("none"),
            lambda: module(q, k, v),
            lambda: F.scaled_dot_product_attention(q, k, v),
        )
        case(
            name.format("causal"),
            lambda: module(q, k, v, causal=True),
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        )

    # dot rows (8, 512, 512, 64)
    for dt_name, dt in (("f32", torch.float32), ("bf16", torch.bfloat16)):
        q, k, v = rn(8, 512, 64, dt=dt), rn(8, 512, 64, dt=dt), rn(8, 512, 64, dt=dt)
        dpa = attnscore.DotProductAttention().eval()
        L, Ln = lens_b(8, 512), lens_bn(8, 512, 512)
        nothing_padded("dot {} " + dt_name + " fwd", q, k, v, dpa)
        mask = torch.arange(512) < L.view(8, 1, 1)
        case(
            f"dot lengths (B,) {dt_name} fwd",
            lambda q=q, k=k, v=v, dpa=dpa, L=L: dpa(q, k, v, L),
            lambda q=q, k=k, v=v, mask=mask: F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask
            ),
        )
        case(
            f"dot lengths (B, n) {dt_name} fwd",
            lambda q=q, k=k, v=v, dpa=dpa, L=Ln: dpa(q, k, v, L),
        )
        am = torch.rand(8, 512, 512, generator=g) > 0.3
        case(
            f"dot bool {dt_name} fwd",
            lambda q=q, k=k, v=v, dpa=dpa, am=am: dpa(q, k, v, attend_mask=am),
            lambda q=q, k=k, v=v, am=am: F.scaled_dot_product_attention(q, k, v, attn_mask=am),
        )
    qg, kg, vg = rn(8, 512, 64, grad=True), rn(8, 512, 64, grad=True), rn(8, 512, 64, grad=True)
    dpa = attnscore.DotProductAttention()
    L = lens_b(8, 512)
    mask = torch.arange(512) < L.view(8, 1, 1)
    L8 = L
    mask8 = mask
    case(
        "dot lengths (B,) f32 fwd+bwd",
        fwdbwd(lambda: dpa(qg, kg, vg, L8), qg, kg, vg),
        fwdbwd(lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=mask8), qg, kg, vg),
    )
    case(
        "dot none f32 fwd+bwd",
        fwdbwd(lambda: dpa(qg, kg, vg), qg, kg, vg),
        fwdbwd(lambda: F.scaled_dot_product_attention(qg, kg, vg), qg, kg, vg),
    )
    # heads (4, 8, 256, 256, 64) training by lengths
    qh, kh, vh = (rn(4, 8, 256, 64, grad=True) for _ in range(3))
    Lh = lens_b(4, 256)
    case("heads lengths (B,) f32 fwd+bwd", fwdbwd(lambda: dpa(qh, kh, vh, Lh), qh, kh, vh))
    qc, kc, vc = (t.detach() for t in (qh, kh, vh))
    case("heads causal + lengths f32 fwd", lambda: dpa(qc, kc, vc, Lh, causal=True))
    # the function (not the module): it keeps nothing for weights
    fdpa = attnscore.dot_product_attention
    case(
        "function heads lengths (B,) f32 fwd+bwd",
        fwdbwd(lambda: fdpa(qh, kh, vh, Lh), qh, kh, vh),
    )
    case("function heads lengths (B,) f32 fwd", lambda: fdpa(qc, kc, vc, Lh))
    case(
        "dot causal + lengths f32 fwd+bwd",
        fwdbwd(lambda: dpa(qg, kg, vg, L8, causal=True), qg, kg, vg),
    )
    # multihead B=8 n=256 E=256 H=4
    mha = attnscore.MultiHeadAttention(256, 4)
    x = rn(8, 256, 256)
    Lm = lens_b(8, 256)
    mha(x, x, x, Lm)
    case("multihead lengths (B,) fwd+bwd", fwdbwd(lambda: mha(x, x, x, Lm), x))
    case("multihead causal + lengths fwd", lambda: mha(x, x, x, Lm, causal=True))
    # additive B=4 n=128 m=256 h=128 d=64
    add = attnscore.AdditiveAttention(64, 64, 128)
    qa, ka, va = rn(4, 128, 64, grad=True), rn(4, 256, 64, grad=True), rn(4, 256, 64, grad=True)
    La = lens_b(4, 256)
    case("additive lengths (B,) fwd+bwd", fwdbwd(lambda: add(qa, ka, va, La), qa, ka, va))
    # general (8, 256, 256, 64)
    gen = attnscore.MultiplicativeAttention(64, 64)
    qq, kk, vv = rn(8, 256, 64), rn(8, 256, 64), rn(8, 256, 64)
    Lg = lens_bn(8, 256, 256)
    case("general lengths (B, n) fwd", lambda: gen(qq, kk, vv, Lg))
    case("cosine none fwd", lambda: attnscore.CosineAttention()(qq, kk, vv))
    # masked softmax (32, 256, 1024)
    X = rn(32, 256, 1024)
    Ls = lens_b(32, 1024)
    case(
        "masked_softmax lengths (B,) f32 fwd",
        lambda: attnscore.masked_softmax(X, Ls),
        lambda: torch.softmax(X, -1),
    )
    # tiny (2, 4, 8, 8) and mid (2, 64, 64, 32)
    for size, (B, n, m, d) in (("tiny", (2, 4, 8, 8)), ("mid", (2, 64, 64, 32))):
        q, k, v = rn(B, n, d), rn(B, m, d), rn(B, m, d)
        L = lens_b(B, m)
        dpa_e = attnscore.DotProductAttention().eval()
        case(
            f"dot ({size}) lengths",
            lambda q=q, k=k, v=v, L=L, f=dpa_e: f(q, k, v, L),
            lambda q=q, k=k, v=v, L=L, B=B, m=m: F.scaled_dot_product_attention(
                q, k, v, attn_mask=torch.arange(m) < L.view(B, 1, 1)
            ),  # the mask built per call, as a user would
        )
        nothing_padded(f"dot ({size}) {{}}", q, k, v, dpa_e)
        a = attnscore.AdditiveAttention(d, d, 8).eval()
        case(f"additive ({size}) lengths", lambda q=q, k=k, v=v, L=L, f=a: f(q, k, v, L))
        gm = attnscore.MultiplicativeAttention(d, d).eval()
        case(f"general ({size}) lengths", lambda q=q, k=k, v=v, L=L, f=gm: f(q, k, v, L))
        case(f"general ({size}) none", lambda q=q, k=k, v=v, f=gm: f(q, k, v))
    # decoder step: additive, B=128, m=20, h=256
    dec = attnscore.AdditiveAttention(256, 256, 256).eval()
    enc = rn(128, 20, 256)
    qd = rn(128, 1, 256)
    Ld = lens_b(128, 20)
    case("decoder_step", lambda: dec(qd, enc, enc, Ld))
    out = {}
    with torch.inference_mode(False):
        for name, (fn, base) in cases.items():
            if only and not any(o in name for o in only):
                continue
            grad = "bwd" in name
            ctx = torch.enable_grad() if grad else torch.no_grad()
            with ctx:
                fn()
                fn()
                t = (
                    benchmark.Timer("fn()", globals={"fn": fn})
                    .blocked_autorange(min_run_time=0.4)
                    .median
                )
                b = None
                if base is not None:
                    base()
                    base()
                    b = (
                        benchmark.Timer("fn()", globals={"fn": base})
                        .blocked_autorange(min_run_time=0.4)
                        .median
                    )
            out[name] = (t, b)
    print(json.dumps(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("old", help="the old tree's src folder")
    parser.add_argument("new", help="the new tree's src folder")
    parser.add_argument("cases", nargs="*", help="only cases whose name contains one of these")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)
    if args.worker:
        worker(args.cases)
        return 0
    trees = {"old": os.path.abspath(args.old), "new": os.path.abspath(args.new)}
    res: dict[str, dict[str, list[tuple[float, float | None]]]] = {k: {} for k in trees}
    for r in range(args.rounds):
        for tag in ("old", "new") if r % 2 == 0 else ("new", "old"):
            env = {**os.environ, "PYTHONPATH": trees[tag]}
            env["ATTNSCORE_CACHE"] = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"ab-{tag}")
            cmd = [sys.executable, __file__, args.old, args.new, *args.cases, "--worker"]
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if proc.returncode:
                sys.stderr.write(proc.stderr[-3000:])
                return 1
            for name, (t, b) in json.loads(proc.stdout.strip().splitlines()[-1]).items():
                res[tag].setdefault(name, []).append((t, b))
    print(f"{'case':40s} {'old ms':>9s} {'new ms':>9s} {'new/old':>8s} {'old/torch':>9s} "
          f"{'new/torch':>9s}")  # fmt: skip
    for name in res["new"]:
        o = statistics.median(t for t, _ in res["old"][name]) * 1e3
        n = statistics.median(t for t, _ in res["new"][name]) * 1e3

        def vs(tag: str, name: str = name) -> str:
            rs = [t / b for t, b in res[tag][name] if b]
            return f"{statistics.median(rs):.2f}x" if rs else "-"

        print(f"{name:40s} {o:9.4f} {n:9.4f} {n / o:7.3f}x {vs('old'):>9s} {vs('new'):>9s}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
