"""Grapheme-to-phoneme conversion on CMUdict: a real task for the attention scorers.

Sub-modules, one job each: :mod:`.data` (parsing, split, vocabularies, batches),
:mod:`.scorers` (``--scoring`` registry), :mod:`.model` (encoder-decoder),
:mod:`.metrics` (PER/WER), :mod:`.evaluate` (decoding a split), :mod:`.checkpoint`,
:mod:`.train` (loop, budgets, DDP), :mod:`.compare` and :mod:`.cli`.
"""
