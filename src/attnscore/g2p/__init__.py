"""Grapheme-to-phoneme conversion on CMUdict: a real task for the attention scorers.

Sub-modules, one job each, imported in this order (no cycles): :mod:`.config`
(ModelConfig inside TrainConfig), :mod:`.state` (TrainState), :mod:`.progress`,
:mod:`.data` (parsing, split, vocabularies, batches), :mod:`.metrics` (PER/WER),
:mod:`.model` (encoder-decoder, scorers from :mod:`attnscore.registry`), :mod:`.checkpoint`
(safe files), :mod:`.evaluate` (decoding), :mod:`.plots` (figures), :mod:`.train` (loop,
budgets, DDP), :mod:`.commands` and :mod:`.compare` (handlers), :mod:`.cli` (argparse).
"""
