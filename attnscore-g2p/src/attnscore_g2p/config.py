"""The configurations of a G2P run: :class:`ModelConfig` inside :class:`TrainConfig`.

Their field defaults are the recipe of docs/g2p.md and the one source of the command
line's defaults (:mod:`attnscore_g2p.cli`), which builds a configuration from its options
by field name (:meth:`TrainConfig.from_fields`). Both configurations are stored in
checkpoints and summaries as plain dicts (:meth:`TrainConfig.to_dict`), so a checkpoint
holds no pickled objects.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar, TypeVar

DEFAULT_STEPS = 15_000
"""Step budget when neither ``--steps`` nor ``--time-budget`` is given."""

PRECISIONS = ("float32", "bfloat16")
"""The values of :attr:`TrainConfig.precision`."""


def known_fields(cls: type, d: Mapping[str, Any], exclude: Collection[str] = ()) -> dict[str, Any]:
    """The entries of ``d`` that name fields of the dataclass ``cls``, less ``exclude``
    (what every ``from_dict`` here builds from: unknown keys are ignored).

    >>> known_fields(ModelConfig, {"emb": 8, "other": 1})
    {'emb': 8}
    """
    names = {f.name for f in fields(cls)} - set(exclude)
    return {k: v for k, v in d.items() if k in names}


R = TypeVar("R", bound="Record")


class Record:
    """A dataclass kept as a plain dict in checkpoints and JSON files: :meth:`to_dict` and
    its inverse :meth:`from_dict`, the base of every record of the G2P task.

    >>> ModelConfig.from_dict({**ModelConfig(emb=8).to_dict(), "other": 1}).emb
    8
    """

    __dataclass_fields__: ClassVar[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, nested records as dicts (checkpoint- and JSON-safe)."""
        return asdict(self)

    @classmethod
    def from_dict(cls: type[R], d: Mapping[str, Any]) -> R:
        """Inverse of :meth:`to_dict`; unknown keys are ignored."""
        return cls(**known_fields(cls, d))


@dataclass(frozen=True)
class ModelConfig(Record):
    """Hyper-parameters of :class:`~attnscore_g2p.model.G2PModel`.

    The vocabulary sizes are not part of it: they come from the data (and the vocabularies
    stored in a checkpoint).
    """

    scoring: str = "cosine"
    """A scorer name of :mod:`attnscore.registry`."""
    emb: int = 64
    enc_hidden: int = 256
    dec_hidden: int = 256
    enc_layers: int = 1
    dropout: float = 0.1
    input_feeding: bool = False


@dataclass(frozen=True)
class TrainConfig(Record):
    """Everything a training run depends on (stored in its checkpoints and summary)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    out: str = "runs/g2p"
    data: str | None = None
    keep_stress: bool = False
    batch_size: int = 128
    lr: float = 2e-3
    lr_min_ratio: float = 0.05
    warmup_steps: int = 200
    """Linear learning-rate warm-up over the first steps (then cosine decay)."""
    label_smoothing: float = 0.1
    clip: float = 5.0
    precision: str = "float32"
    """``"float32"``, or ``"bfloat16"``: each step's forward pass and loss run under
    ``torch.autocast`` in bfloat16 (weights, gradients and the optimizer stay float32)."""
    steps: int | None = None
    """The budget in optimizer steps; the learning-rate schedule is defined over it."""
    time_budget: float | None = None
    """Minutes; turned once into ``steps`` by a timed warm-up (recorded in the run)."""
    average_last: float = 0.2
    """Average the weights over this final fraction of the steps (0: no averaging)."""
    seed: int = 0
    eval_every: int = 1000
    ckpt_every: int = 200
    eval_words: int | None = None
    max_train_words: int | None = None
    threads: int = 1
    nprocs: int = 1
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(
                f"Expected precision to be one of {', '.join(PRECISIONS)}, "
                f"but got {self.precision!r} instead"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> TrainConfig:
        """Inverse of :meth:`to_dict` (the model config nested under ``"model"``); unknown
        keys are ignored."""
        model = ModelConfig.from_dict(d.get("model", {}))
        return cls(model=model, **known_fields(cls, d, {"model"}))

    @classmethod
    def from_fields(cls, values: Mapping[str, Any]) -> TrainConfig:
        """The configuration whose fields, the model's included, are named in one flat mapping.

        Args:
            values: field name -> value, for fields of :class:`TrainConfig` and of
                :class:`ModelConfig` alike (no name is in both); other names are ignored,
                and fields it does not name keep their defaults.

        Returns:
            The configuration.

        >>> cfg = TrainConfig.from_fields({"scoring": "additive", "lr": 1e-3, "other": 1})
        >>> cfg.model.scoring, cfg.lr, cfg.batch_size
        ('additive', 0.001, 128)
        """
        model = ModelConfig(**known_fields(ModelConfig, values))
        return cls(model=model, **known_fields(cls, values, {"model"}))
