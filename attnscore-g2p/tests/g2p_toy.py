"""A toy lexicon in cmudict format that the model learns in a few seconds (imported as
``g2p_toy``: a name of its own, where ``conftest`` is also tests/conftest.py's)."""

from __future__ import annotations

import random

# letters -> phonemes of a toy language the model can learn in a few seconds
TOY_MAP = {"a": "AE1", "b": "B", "d": "D", "e": "IY0", "k": "K", "m": "M", "o": "OW1", "s": "S"}


def toy_lexicon_text(n_words: int = 240, seed: int = 0) -> str:
    """cmudict-format text of ``n_words`` random toy words with a regular pronunciation."""
    rng = random.Random(seed)
    letters = sorted(TOY_MAP)
    words = set()
    while len(words) < n_words:
        words.add("".join(rng.choice(letters) for _ in range(rng.randint(2, 6))))
    return "".join(f"{w} {' '.join(TOY_MAP[c] for c in w)}\n" for w in sorted(words))
