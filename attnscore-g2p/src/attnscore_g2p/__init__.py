"""Grapheme-to-phoneme conversion on CMUdict: a real task for attnscore's attention scorers,
in a distribution of its own (attnscore-g2p) beside the library.

Sub-modules, one job each, imported in this order (no cycles): :mod:`.config`
(ModelConfig inside TrainConfig), :mod:`.state` (TrainState, Validation), :mod:`.summary`
(RunSummary, Budget), :mod:`.data` (parsing, split, vocabularies, batches), :mod:`.dataset`
(a run's data), :mod:`.metrics` (PER/WER), :mod:`.model` (encoder-decoder, scorers from
:mod:`attnscore.registry`), :mod:`.checkpoint` (safe files, CheckpointError),
:mod:`.evaluate` (decoding), :mod:`.plots` (figures), :mod:`.schedule` (learning rate),
:mod:`.distributed` (DDP processes), :mod:`.stepper` (one optimizer step), :mod:`.budget`
(time budget -> steps), :mod:`.loop` (the training loop), :mod:`.train` (entry points),
:mod:`.compare` (runs -> tables). The command line is :mod:`.cli` (with :mod:`._handlers`),
which ``attnscore g2p`` finds through :mod:`.command`; nothing else here raises its
``UsageError``.
"""

__version__ = "0.1.0"
