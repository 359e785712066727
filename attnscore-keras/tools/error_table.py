"""Max error of each layer against attnscore's PyTorch module and against float64, on one
Keras backend (needs torch and attnscore):

    KERAS_BACKEND=jax python tools/error_table.py --json jax-err.json
    KERAS_BACKEND=tensorflow python tools/error_table.py --json tf-err.json
    python tools/error_table.py --table jax-err.json tf-err.json

For each layer and dtype: a seeded PyTorch module (float32 weights, rounded to the dtype),
the Keras layer from ``from_torch(module, dtype=...)``, inputs (B=4, n=6, m=9, sizes 16)
rounded to the dtype, key lengths (B,) with one 0. "vs PyTorch": max |Keras - module| with
both in the dtype; "vs float64": max |Keras - module in float64 on the same rounded
weights and inputs|. The PyTorch module's own float64 error is listed beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

DTYPES = ("float32", "float16", "bfloat16")
B, N, M, S = 4, 6, 9, 16


def modules() -> dict[str, Any]:
    import torch

    import attnscore

    torch.manual_seed(0)
    return {
        "AdditiveAttention": attnscore.AdditiveAttention(S, S, 32, bias=True),
        "DotProductAttention": attnscore.DotProductAttention(),
        "MultiplicativeAttention": attnscore.MultiplicativeAttention(S, S),
        "CosineAttention": attnscore.CosineAttention(learn_scale=True),
        "MultiHeadAttention": attnscore.MultiHeadAttention(S, 4, bias=True, query_size=S),
    }


def measure() -> list[dict[str, Any]]:
    import copy

    import attnscore_keras as ak
    import keras
    import numpy as np
    import torch

    rows = []
    rng = np.random.default_rng(0)
    x = [rng.normal(size=(B, N, S)), rng.normal(size=(B, M, S)), rng.normal(size=(B, M, S))]
    lens = np.array([M, 5, 0, 3])
    for name, module in modules().items():
        for dtype in DTYPES:
            tdt = getattr(torch, dtype)
            low = copy.deepcopy(module).to(tdt).eval()
            wide = copy.deepcopy(low).to(torch.float64)  # the same rounded weights
            inputs = [torch.from_numpy(a).to(tdt) for a in x]
            with torch.no_grad():
                theirs = low(*inputs, torch.from_numpy(lens)).double().numpy()
                exact = wide(*(a.double() for a in inputs), torch.from_numpy(lens)).numpy()
            layer = ak.from_torch(low, dtype=dtype)
            ours_in = [keras.ops.convert_to_tensor(a.float().numpy(), dtype=dtype) for a in inputs]
            out = layer(*ours_in, keras.ops.convert_to_tensor(lens))
            ours = np.asarray(keras.ops.convert_to_numpy(keras.ops.cast(out, "float64")))
            rows.append(
                {
                    "backend": keras.backend.backend(),
                    "layer": name,
                    "dtype": dtype,
                    "vs_torch": float(np.abs(ours - theirs).max()),
                    "vs_float64": float(np.abs(ours - exact).max()),
                    "torch_vs_float64": float(np.abs(theirs - exact).max()),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(paths: list[str]) -> str:
    lines = [
        "| layer | backend | dtype | vs PyTorch module | vs float64 | (PyTorch vs float64) |",
        "|---|---|---|---:|---:|---:|",
    ]
    rows = [row for path in paths for row in json.loads(Path(path).read_text())["rows"]]
    rows.sort(key=lambda r: (r["layer"], r["backend"], DTYPES.index(r["dtype"])))
    for r in rows:
        lines.append(
            f"| {r['layer']} | {r['backend']} | {r['dtype']} | {r['vs_torch']:.1e} | "
            f"{r['vs_float64']:.1e} | {r['torch_vs_float64']:.1e} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--table", nargs="+", help="print the Markdown table of result files")
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    rows = measure()
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
