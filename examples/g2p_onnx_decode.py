"""Pronounce words with a G2P model exported by ``attnscore g2p export``: ONNX Runtime and
NumPy only (no torch, no attnscore).

    attnscore g2p export runs/g2p --out g2p.onnx
    python examples/g2p_onnx_decode.py g2p.onnx knight phoneme
    python examples/g2p_onnx_decode.py g2p.onnx --file words.txt    # one word a line

Prints ``word<TAB>phonemes`` per word, as ``attnscore g2p predict RUN --beam 1`` does, with
the same phonemes: the file's graph is the model's greedy decoding of words padded to its
``max_letters``, unrolled for ``max_letters + 10`` steps; this script batches the words as
``predict`` does (by length, 256 a batch) and, as the model's greedy decoding, keeps each
word's phonemes up to the first ``</s>`` within ``longest word of the batch + 10`` steps.
A word with letters the model never saw, or longer than ``max_letters``: one line on
stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import onnxruntime as ort

BATCH = 256  # words per run, as `attnscore g2p predict` batches them
EXTRA_STEPS = 10  # decoder steps beyond a batch's longest word


def load(path: str) -> tuple[ort.InferenceSession, dict]:
    """The session of the exported file and its metadata (vocabularies, sizes); exit 2 with
    one line for a file that cannot be read or was not written by ``attnscore g2p export``."""
    try:
        session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    except Exception as err:  # onnxruntime's errors have no common public base class
        print(f"error: {path}: cannot load the model ({str(err).splitlines()[0]})", file=sys.stderr)
        raise SystemExit(2) from None
    meta = session.get_modelmeta().custom_metadata_map.get("attnscore.g2p")
    if meta is None:
        print(f"error: {path}: not a file of `attnscore g2p export`", file=sys.stderr)
        raise SystemExit(2)
    return session, json.loads(meta)


def check(words: list[str], meta: dict) -> list[str]:
    """The words lower-cased; exit 2 with one line for one the model cannot spell."""
    letters = set(meta["letters"][4:])  # after <pad>, <s>, </s>, <unk>
    out = []
    for word in words:
        lower = word.lower()
        unknown = sorted({c for c in lower if c not in letters})
        if not lower or unknown or len(lower) > meta["max_letters"]:
            why = (
                f"unknown letters {', '.join(map(repr, unknown))}"
                if unknown
                else "an empty word"
                if not lower
                else f"longer than the model's {meta['max_letters']} letters"
            )
            print(f"error: cannot pronounce {word!r}: {why}", file=sys.stderr)
            raise SystemExit(2)
        out.append(lower)
    return out


def pronounce(session: ort.InferenceSession, meta: dict, words: list[str]) -> list[list[str]]:
    """The phonemes of each word, by greedy decoding."""
    stoi = {c: i for i, c in enumerate(meta["letters"])}
    phones, eos, skip = meta["phones"], meta["eos_id"], {meta["pad_id"], meta["bos_id"]}
    order = sorted(range(len(words)), key=lambda i: len(words[i]))
    result: list[list[str]] = [[] for _ in words]
    for start in range(0, len(order), BATCH):
        batch = order[start : start + BATCH]
        lengths = np.array([len(words[i]) for i in batch], dtype=np.int64)
        letters = np.full((len(batch), meta["max_letters"]), meta["pad_id"], dtype=np.int64)
        for row, i in enumerate(batch):
            letters[row, : lengths[row]] = [stoi[c] for c in words[i]]
        (ids,) = session.run(None, {"letters": letters, "valid_lens": lengths})
        for row, i in enumerate(batch):
            for token in ids[row, : lengths.max() + EXTRA_STEPS].tolist():
                if token == eos:
                    break
                if token not in skip:
                    result[i].append(phones[token])
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the .onnx file of `attnscore g2p export`")
    parser.add_argument("words", nargs="*", metavar="WORD")
    parser.add_argument("--file", help="also pronounce the words of this file, one a line")
    args = parser.parse_args(argv)
    words = list(args.words)
    if args.file is not None:
        with open(args.file, encoding="utf-8") as f:
            words += [line.strip() for line in f if line.strip()]
    session, meta = load(args.model)
    words = check(words, meta)
    for word, phonemes in zip(words, pronounce(session, meta, words), strict=True):
        print(f"{word}\t{' '.join(phonemes)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
