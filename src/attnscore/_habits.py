"""PyTorch's attention arguments, and what attnscore takes instead.

A keyword argument that no attnscore entry point takes is refused with one ``TypeError``;
where it is an argument of ``F.scaled_dot_product_attention`` or ``nn.MultiheadAttention``
(a habit a PyTorch user brings along), the error names attnscore's equivalent, with each
mask's polarity. ``docs/coming_from_pytorch.md`` is the same table for readers.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

from typing_extensions import ParamSpec

__all__ = ["HABITS", "Habit", "Where", "check_keywords", "refuses_pytorch_keywords"]

Where = Literal["function", "forward", "multihead forward", "MultiHeadAttention"]
"""Who takes the keywords: a functional form of :mod:`attnscore.functional`, the
``forward`` of an attention module, :class:`~attnscore.MultiHeadAttention`'s ``forward``,
or its constructor."""

_SDPA = "F.scaled_dot_product_attention's"
_MHA = "nn.MultiheadAttention's"
_BOTH = "F.scaled_dot_product_attention's and nn.MultiheadAttention's"
_CALLS: tuple[Where, ...] = ("function", "forward", "multihead forward")


@dataclass(frozen=True)
class Habit:
    """A PyTorch argument: whose it is, attnscore's equivalent (``hint``), and where the
    hint differs (``hints`` by :data:`Where`); ``where``: the entry points it is refused at
    (where it is taken under the same name, it means the same)."""

    origin: str
    hint: str
    where: tuple[Where, ...] = _CALLS
    hints: Mapping[Where, str] = field(default_factory=dict)

    def hint_for(self, where: Where) -> str:
        return self.hints.get(where, self.hint)


_ATTN_MASK = (
    "attnscore's is `attend_mask`, a bool mask broadcastable to (..., n, m) with True = may "
    "attend: `attend_mask=attn_mask` for F.scaled_dot_product_attention's bool mask (the same "
    "polarity), `attend_mask=~attn_mask` for nn.MultiheadAttention's (True = not allowed "
    "there); an additive float mask of 0 and -inf is `attend_mask=attn_mask == 0` (other "
    "float biases belong in a scoring function)"
)
_MHA_ATTN_MASK = (
    "attnscore's is `attend_mask`, a bool mask (n, m), (B, n, m) or (B, H, n, m) with "
    "True = may attend, the opposite of nn.MultiheadAttention's bool attn_mask (True = not "
    "allowed): pass `attend_mask=~attn_mask` (a (B*H, n, m) one as "
    "`~attn_mask.view(B, H, n, m)`); an additive float mask of 0 and -inf is "
    "`attend_mask=attn_mask == 0`"
)
_KEY_PADDING = (
    "its (B, m) mask means True = ignore; attnscore takes key lengths `valid_lens` (B,), "
    "`valid_lens=(~key_padding_mask).sum(1)` where the padding is at the end, or the bool "
    "`attend_mask` with True = may attend, `attend_mask=~key_padding_mask[:, None, :]`"
)
_NEED_WEIGHTS = (
    "attnscore's is `return_weights=True`, which returns (output, weights) with the weights "
    "(..., n, m); need_weights=False is the default"
)
_PER_HEAD = (
    "attnscore's is `return_weights=True`, which returns (output, weights) with the weights "
    "of every head (B, H, n, m) (need_weights=False is the default); nn.MultiheadAttention's "
    "default average over heads is `weights.mean(dim=1)`"
)
_AVERAGE = (
    "attnscore returns the weights of every head (B, H, n, m) (`return_weights=True`), as "
    "average_attn_weights=False; their average over heads, nn.MultiheadAttention's default, "
    "is `weights.mean(dim=1)`"
)
_MODULE_DROPOUT = (
    "a module's dropout on the weights is set when it is built (`dropout=`) and acts in "
    "training mode only (`module.train()`, `module.eval()`); the functional forms take "
    "`dropout_p`"
)

HABITS: dict[str, Habit] = {
    "query": Habit(_BOTH, "attnscore's name is `queries`, the first argument"),
    "key": Habit(_BOTH, "attnscore's name is `keys`, the second argument"),
    "value": Habit(_BOTH, "attnscore's name is `values`, the third argument"),
    "attn_mask": Habit(_BOTH, _ATTN_MASK, hints={"multihead forward": _MHA_ATTN_MASK}),
    "key_padding_mask": Habit(
        _MHA,
        f"{_KEY_PADDING} (`[:, None, None, :]` for (B, H, n, d) inputs)",
        hints={"multihead forward": _KEY_PADDING},
    ),
    "is_causal": Habit(
        _BOTH,
        "attnscore's is `causal=True`: query i attends keys j <= i (top-left aligned, as "
        "F.scaled_dot_product_attention's is_causal)",
    ),
    "need_weights": Habit(_MHA, _NEED_WEIGHTS, hints={"multihead forward": _PER_HEAD}),
    "average_attn_weights": Habit(_MHA, _AVERAGE),
    "dropout_p": Habit(_SDPA, _MODULE_DROPOUT, where=("forward", "multihead forward")),
    "scale": Habit(
        _SDPA,
        "dot_product_attention takes `scale=` (None = 1/sqrt(d)); another scorer's scale "
        "belongs in its scoring function",
        hints={
            "forward": "a module's scale is set when it is built: `DotProductAttention("
            "scale=...)` (None = 1/sqrt(d))",
            "multihead forward": "the scale is set when the module is built: "
            "`MultiHeadAttention(..., scoring=DotProductAttention(scale=...))`",
        },
    ),
    "enable_gqa": Habit(
        _SDPA,
        "there is no flag: repeat the keys and values over the query heads that share them, "
        "`keys.repeat_interleave(H // H_kv, dim=-3)` (and the values alike), then call as "
        "usual",
    ),
    "dropout": Habit(
        _MHA, "the functional forms take `dropout_p` (0 in evaluation)", where=("function",)
    ),
    "embed_dim": Habit(
        _MHA,
        "attnscore's `num_hiddens` (the first argument) is the model size E of the "
        "projections and the output, and `query_size` the queries' size (key_size and "
        "value_size default to it, as kdim and vdim to embed_dim): "
        "nn.MultiheadAttention(E, H) is MultiHeadAttention(E, H, bias=True, query_size=E); "
        "MultiHeadAttention.from_torch(module) converts one, weights included",
        where=("MultiHeadAttention",),
    ),
    "kdim": Habit(_MHA, "attnscore's is `key_size`", where=("MultiHeadAttention",)),
    "vdim": Habit(_MHA, "attnscore's is `value_size`", where=("MultiHeadAttention",)),
    "batch_first": Habit(
        _MHA,
        "attnscore's inputs are batch-first (B, n, E) always, as batch_first=True; for "
        "(n, B, E) inputs pass `x.transpose(0, 1)` and transpose the output back",
        where=("MultiHeadAttention",),
    ),
    "add_bias_kv": Habit(
        _MHA,
        "attnscore has no equivalent (no learned key and value appended to the sequence)",
        where=("MultiHeadAttention",),
    ),
    "add_zero_attn": Habit(
        _MHA,
        "attnscore has no equivalent and needs none: a query with no key to attend gets zero "
        "weights and a zero attention output, not NaN",
        where=("MultiHeadAttention",),
    ),
    "device": Habit(
        _MHA,
        "build the module, then move it: `MultiHeadAttention(...).to(device)`",
        where=("MultiHeadAttention",),
    ),
    "dtype": Habit(
        _MHA,
        "build the module, then convert it: `MultiHeadAttention(...).to(dtype)`",
        where=("MultiHeadAttention",),
    ),
}
"""Every argument of ``F.scaled_dot_product_attention`` and ``nn.MultiheadAttention`` that
some attnscore entry point does not take under the same name and meaning, by name."""


def check_keywords(given: Collection[str], accepted: Collection[str], where: Where) -> None:
    """Refuse the keywords among ``given`` that are not ``accepted``, with one TypeError:
    for a PyTorch argument (:data:`HABITS`), naming attnscore's equivalent; otherwise
    listing what is accepted. Cheap when every keyword is accepted (the common case)."""
    unknown = [name for name in given if name not in accepted]
    if not unknown:
        return
    for name in unknown:
        habit = HABITS.get(name)
        if habit is not None and where in habit.where:
            raise TypeError(
                f"Unexpected keyword argument `{name}` ({habit.origin}): {habit.hint_for(where)}."
            )
    raise TypeError(
        f"Unexpected keyword argument(s) {sorted(unknown)}: expected keywords among "
        f"{sorted(accepted)}."
    )


P = ParamSpec("P")
R = TypeVar("R")


def refuses_pytorch_keywords(where: Where) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorate a constructor so that a keyword it does not take is refused by
    :func:`check_keywords` (naming attnscore's equivalent of a PyTorch argument) rather
    than by Python's bare ``unexpected keyword argument``; its signature is unchanged."""

    def decorate(init: Callable[P, R]) -> Callable[P, R]:
        names = frozenset(inspect.signature(init).parameters) - {"self"}

        @functools.wraps(init)
        def checked(*args: P.args, **kwargs: P.kwargs) -> R:
            check_keywords(kwargs, names, where)
            return init(*args, **kwargs)

        return checked

    return decorate
