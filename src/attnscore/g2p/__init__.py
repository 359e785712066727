"""Grapheme-to-phoneme conversion on CMUdict: a real task for the attention scorers.

Sub-modules, one job each, imported in this order (no cycles): :mod:`.config`
(ModelConfig inside TrainConfig), :mod:`.state` (TrainState, Validation), :mod:`.summary`
(RunSummary, Budget), :mod:`.progress`, :mod:`.data` (parsing, split, vocabularies,
batches), :mod:`.dataset` (a run's data), :mod:`.metrics` (PER/WER), :mod:`.model`
(encoder-decoder, scorers from :mod:`attnscore.registry`), :mod:`.checkpoint` (safe files,
CheckpointError), :mod:`.evaluate` (decoding), :mod:`.plots` (figures), :mod:`.schedule`
(learning rate), :mod:`.distributed` (DDP
processes), :mod:`.stepper` (one optimizer step), :mod:`.budget` (time budget -> steps),
:mod:`.loop` (the training loop), :mod:`.train` (entry points), :mod:`.compare` (runs ->
tables). The command line is :mod:`attnscore.cli.g2p`; nothing here raises its
``UsageError``.
"""
