"""Speed of attnscore_keras against Keras's own attention layers, on one Keras backend.

    KERAS_BACKEND=jax python tools/bench.py --json jax.json
    KERAS_BACKEND=tensorflow python tools/bench.py --json tf.json
    python tools/bench.py --table jax.json tf.json      # the Markdown table of both
    # old against new in one process: another checkout's layers timed in the same rounds
    KERAS_BACKEND=jax python tools/bench.py --against ../old/attnscore-keras/src \
        --shape bert --layer DotProductAttention --mask lengths

Pairs (the same work on both sides, float32):

- ``MultiHeadAttention`` (scaled dot product, biases) against
  ``keras.layers.MultiHeadAttention`` with ``attention_mask`` built from the key lengths
  (``arange(m) < lens``), and ours with ``valid_lens``;
- ``DotProductAttention(scale=1.0)`` against ``keras.layers.Attention()`` (unscaled dot
  scores), with lengths (Keras: ``mask=[None, arange(m) < lens]``) and without.

Shapes: a BERT-base-size call (B=8, n=m=128, E=768, H=12; the dot layers on (B*H, 128,
64)) and a small decoder step (B=8, n=1, m=32, E=256, H=4; dot layers on (B*H, 1 / 32,
64)). Forward: the output; training step: the gradients of sum(output²) with respect to
the weights and the queries. Each call is compiled (``jax.jit``,
``tf.function(jit_compile=True)``); rounds alternate which side runs first; the ratio is
ours over theirs of the median time (below 1: ours is faster). On JAX each row also
records how many top-level instructions (kernels, library calls) XLA runs for each side
(``ours_ops``, ``theirs_ops``): at the decoder step each costs about a microsecond.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

SHAPES = {
    "bert": {"B": 8, "n": 128, "m": 128, "E": 768, "H": 12},
    "decoder": {"B": 8, "n": 1, "m": 32, "E": 256, "H": 4},
}


def _compiled(fn: Any) -> Any:
    import keras

    if keras.backend.backend() == "jax":
        import jax

        return jax.jit(fn)
    import tensorflow as tf

    return tf.function(fn, jit_compile=True)


def _grad_step(layer: Any, call: Any) -> Any:
    """A compiled training step: d sum(call(weights, q, ...)²) / d (weights, q)."""
    import keras

    if keras.backend.backend() == "jax":
        import jax

        def loss(ws: Any, q: Any, *rest: Any) -> Any:
            out = call(ws, q, *rest)
            return (out * out).sum()

        return jax.jit(jax.grad(loss, argnums=(0, 1)))
    import tensorflow as tf

    def step(ws: Any, q: Any, *rest: Any) -> Any:
        with tf.GradientTape() as tape:
            tape.watch([*ws, q])
            out = call(ws, q, *rest)
            y = tf.reduce_sum(out * out)
        return tape.gradient(y, [*ws, q])

    return tf.function(step, jit_compile=True)


def _block(x: Any) -> None:
    import keras

    for leaf in keras.tree.flatten(x):
        _sync(leaf)


def _sync(leaf: Any) -> None:
    if hasattr(leaf, "block_until_ready"):
        leaf.block_until_ready()
    else:
        leaf.numpy()


def _stateless(layer: Any, kwargs_of: Any) -> Any:
    """``call(weights, q, k, v, lens)`` through ``layer.stateless_call``."""
    others = [w.value for w in layer.non_trainable_variables]

    def call(ws: Any, q: Any, k: Any, v: Any, lens: Any) -> Any:
        args, kwargs = kwargs_of(q, k, v, lens)
        out, _ = layer.stateless_call(list(ws), others, *args, **kwargs)
        return out

    return call


def cases(shape_name: str, ak: Any = None) -> list[dict[str, Any]]:
    """The pairs at one shape; ``ak``: the attnscore_keras package to take ours from (None:
    the one this file's folder holds)."""
    import keras

    if ak is None:
        import attnscore_keras as ak
    import numpy as np
    from keras import ops

    s = SHAPES[shape_name]
    B, n, m, E, H = s["B"], s["n"], s["m"], s["E"], s["H"]
    rng = np.random.default_rng(0)
    lens = rng.integers(m // 2, m + 1, size=B).astype("int32")
    lens[0] = m

    def key_mask(lens_t: Any, batch: int) -> Any:
        return ops.less(ops.arange(m, dtype="int32")[None, :], ops.reshape(lens_t, (batch, 1)))

    x_q = rng.normal(size=(B, n, E)).astype("float32")
    x_kv = rng.normal(size=(B, m, E)).astype("float32")
    ours_mha = ak.MultiHeadAttention(E, H, bias=True)
    theirs_mha = keras.layers.MultiHeadAttention(H, E // H)
    ours_mha(x_q, x_kv, x_kv, lens)
    theirs_mha(x_q, x_kv, x_kv)
    found = [
        {
            "layer": "MultiHeadAttention",
            "mask": "lengths",
            "ours": (ours_mha, _stateless(ours_mha, lambda q, k, v, lens: ((q, k, v, lens), {}))),
            "theirs": (
                theirs_mha,
                _stateless(
                    theirs_mha,
                    lambda q, k, v, lens: (
                        (q, v, k),
                        {
                            "attention_mask": ops.broadcast_to(
                                key_mask(lens, B)[:, None, :], (B, n, m)
                            )
                        },
                    ),
                ),
            ),
            "inputs": (x_q, x_kv, x_kv, lens),
        }
    ]
    d = 64
    BH = B * H
    q = rng.normal(size=(BH, n, d)).astype("float32")
    kv = rng.normal(size=(BH, m, d)).astype("float32")
    lens_bh = np.repeat(lens, H).astype("int32")
    ours_dot = ak.DotProductAttention(scale=1.0)
    theirs_dot = keras.layers.Attention()
    theirs_dot([q, kv, kv])

    def ours_lengths(q: Any, k: Any, v: Any, lens: Any) -> Any:
        return (q, k, v, lens), {}

    def theirs_lengths(q: Any, k: Any, v: Any, lens: Any) -> Any:
        return ([q, v, k],), {"mask": [None, key_mask(lens, BH)]}

    def ours_none(q: Any, k: Any, v: Any, lens: Any) -> Any:
        return (q, k, v), {}

    def theirs_none(q: Any, k: Any, v: Any, lens: Any) -> Any:
        return ([q, v, k],), {}

    for mask in ("lengths", "none"):
        ours_kw, theirs_kw = (
            (ours_lengths, theirs_lengths) if mask == "lengths" else (ours_none, theirs_none)
        )
        found.append(
            {
                "layer": "DotProductAttention",
                "mask": mask,
                "ours": (ours_dot, _stateless(ours_dot, ours_kw)),
                "theirs": (theirs_dot, _stateless(theirs_dot, theirs_kw)),
                "inputs": (q, kv, kv, lens_bh),
            }
        )
    return found


def _ops(fn: Any, args: tuple[Any, ...]) -> int | None:
    """The number of top-level instructions XLA runs for ``fn(*args)`` on JAX (each a
    kernel launch or a library call: parameters, constants, tuples and bitcasts left
    out); None on other backends."""
    import re

    if not hasattr(fn, "lower"):
        return None
    text = fn.lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :].split("\n")[1:]
    skip = r"parameter\(|constant\(| tuple\(|get-tuple-element\(| bitcast\("
    return sum(1 for line in entry if " = " in line and not re.search(skip, line))


def _time(fn: Any, args: tuple[Any, ...], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    _block(out)
    return (time.perf_counter() - start) / reps


def load_old(src: str) -> Any:
    """The attnscore_keras package in the folder ``src`` (another checkout's
    ``attnscore-keras/src``), imported as ``attnscore_keras_old`` beside this one."""
    import importlib.util

    root = Path(src).resolve() / "attnscore_keras"
    spec = importlib.util.spec_from_file_location(
        "attnscore_keras_old", root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["attnscore_keras_old"] = module
    spec.loader.exec_module(module)
    return module


def _wanted(row: dict[str, Any], only: dict[str, str | None]) -> bool:
    return all(value is None or row[key] == value for key, value in only.items())


def measure(
    rounds: int,
    budget_s: float,
    only: dict[str, str | None] | None = None,
    old: Any = None,
) -> list[dict[str, Any]]:
    """Every cell (those ``only`` keeps: shape, layer, mask, mode), ours against theirs;
    with ``old`` (a package from :func:`load_old`) its layer too, in the same rounds."""
    import keras
    from keras import ops

    only = only or {}
    rows = []
    for shape_name in SHAPES:
        old_cases = cases(shape_name, old) if old is not None else None
        for index, case in enumerate(cases(shape_name)):
            tensors = tuple(ops.convert_to_tensor(x) for x in case["inputs"])
            if old_cases is not None:
                case["old"] = old_cases[index]["ours"]
            for mode in ("forward", "train"):
                cell = {"shape": shape_name, "layer": case["layer"], "mask": case["mask"]}
                if not _wanted({**cell, "mode": mode}, only):
                    continue
                sides = ("ours", "theirs", "old") if "old" in case else ("ours", "theirs")
                fns = {}
                for side in sides:
                    layer, call = case[side]
                    ws = [w.value for w in layer.trainable_variables]
                    fn = _compiled(call) if mode == "forward" else _grad_step(layer, call)
                    args = (ws, *tensors)
                    _block(fn(*args))  # compile
                    _block(fn(*args))
                    fns[side] = (fn, args)
                one = _time(*fns["ours"], 1)
                reps = max(1, min(200, int(budget_s / rounds / 2 / max(one, 1e-5))))
                samples: dict[str, list[float]] = {side: [] for side in sides}
                for r in range(rounds):
                    for side in sides if r % 2 == 0 else sides[::-1]:
                        samples[side].append(_time(*fns[side], reps))
                ours = statistics.median(samples["ours"])
                theirs = statistics.median(samples["theirs"])
                row = {
                    "backend": keras.backend.backend(),
                    **cell,
                    "mode": mode,
                    "ours_ms": ours * 1e3,
                    "theirs_ms": theirs * 1e3,
                    "ratio": ours / theirs,
                    "ours_ops": _ops(*fns["ours"]),
                    "theirs_ops": _ops(*fns["theirs"]),
                }
                if "old" in fns:
                    old_s = statistics.median(samples["old"])
                    row.update(
                        old_ms=old_s * 1e3, old_ratio=old_s / theirs, old_ops=_ops(*fns["old"])
                    )
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)
    return rows


def environment() -> dict[str, Any]:
    import keras

    info = {
        "keras": keras.__version__,
        "backend": keras.backend.backend(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    if info["backend"] == "jax":
        import jax

        info["jax"] = jax.__version__
    else:
        import tensorflow as tf

        info["tensorflow"] = tf.__version__
        info["threads"] = (
            tf.config.threading.get_intra_op_parallelism_threads(),
            tf.config.threading.get_inter_op_parallelism_threads(),
        )
    return info


def table(paths: list[str]) -> str:
    lines = [
        "| layer (Keras's) | mask | shape | mode | backend | ours ms | Keras ms | ratio |",
        "|---|---|---|---|---|---:|---:|---:|",
    ]
    theirs_name = {
        "MultiHeadAttention": "MultiHeadAttention (keras.layers.MultiHeadAttention)",
        "DotProductAttention": "DotProductAttention(scale=1) (keras.layers.Attention)",
    }
    rows = [row for path in paths for row in json.loads(Path(path).read_text())["rows"]]
    for row in rows:
        lines.append(
            f"| {theirs_name[row['layer']]} | {row['mask']} | {row['shape']} | {row['mode']} | "
            f"{row['backend']} | {row['ours_ms']:.3f} | {row['theirs_ms']:.3f} | "
            f"{row['ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--budget", type=float, default=3.0, help="seconds per cell and side")
    parser.add_argument("--table", nargs="+", help="print the Markdown table of result files")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="only this shape's cells")
    parser.add_argument("--layer", choices=["DotProductAttention", "MultiHeadAttention"])
    parser.add_argument("--mask", choices=["lengths", "none"])
    parser.add_argument("--mode", choices=["forward", "train"])
    parser.add_argument(
        "--against",
        metavar="SRC",
        help="another checkout's attnscore-keras/src: time its layers too, in the same "
        "rounds (old_ms, old_ratio: old / Keras)",
    )
    args = parser.parse_args(argv)
    if args.table:
        print(table(args.table))
        return 0
    env = environment()
    print(json.dumps(env), flush=True)
    only = {key: getattr(args, key) for key in ("shape", "layer", "mask", "mode")}
    old = load_old(args.against) if args.against else None
    rows = measure(args.rounds, args.budget, only, old)
    if args.json:
        Path(args.json).write_text(json.dumps({"environment": env, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
