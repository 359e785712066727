"""attnscore inside Hugging Face ``transformers`` models (5.x): attention by name.

transformers lets a library register an attention function under a name
(``AttentionInterface.register``) together with the function that builds its masks
(``AttentionMaskInterface.register``); a model then runs it with
``attn_implementation=NAME`` (``from_config``, ``from_pretrained``) or
``model.set_attn_implementation(NAME)``. :func:`register` adds these names:

============================ ==========================================================
name                         computes
============================ ==========================================================
``"attnscore"``              ``softmax(Q Kᵀ · scaling) V``: what ``"sdpa"`` computes
``"attnscore_sparsemax"``    ``sparsemax(Q Kᵀ · scaling) V`` (Martins & Astudillo 2016)
``"attnscore_entmax15"``     ``entmax15(Q Kᵀ · scaling) V`` (Peters et al. 2019)
============================ ==========================================================

Each runs :func:`attnscore.dot_product_attention` on the model's projected queries, keys
and values (:func:`attention_function` says how), with transformers' own ``sdpa_mask`` as
its mask function. The sparse normalizers need the optional ``entmax`` package (``pip
install 'attnscore[entmax]'``); they change what a pretrained model computes, so they are
for models trained with them (from scratch or fine-tuned).

Additive and general (bilinear) scoring are not registered: they need parameters
(``W_q``, ``W_k``, ``w_v``; ``W_a``) that a pretrained transformer does not have, and its
query and key projections were trained for dot products. docs/huggingface.md says more.

transformers is imported only by :func:`register`; ``import attnscore`` never needs it.

Shape legend: B batch, H query heads, H_kv key/value heads (H a multiple of H_kv), n
queries, m keys (the cache included while decoding), d head size, dv value head size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..functional import dot_product_attention
from ..normalizers import NORMALIZERS

__all__ = ["DEFAULT_NORMALIZERS", "AttentionFunction", "attention_function", "register"]

#: The normalizers :func:`register` registers by default, in the order of its names.
DEFAULT_NORMALIZERS = ("softmax", "sparsemax", "entmax15")

#: What transformers calls: ``(module, query, key, value, attention_mask, **kwargs) ->
#: (output (B, n, H, dv), weights (B, H, n, m) or None)``.
AttentionFunction = Callable[..., "tuple[Tensor, Tensor | None]"]

# Keyword arguments some models pass that change the maths in a way this function does not
# implement: refused, never ignored. (transformers' "sdpa" refuses `softcap` too; attention
# sinks and paged caches have implementations of their own there.)
_UNSUPPORTED = {
    "softcap": "logit soft-capping (`softcap`)",
    "s_aux": "attention sinks (`s_aux`)",
    "cache": "a paged cache (continuous batching)",
}


def _name(normalizer: str) -> str:
    """The attention implementation's name for ``normalizer``."""
    return "attnscore" if normalizer == "softmax" else f"attnscore_{normalizer}"


def _check_normalizer(normalizer: object, expected: str) -> str:
    """``normalizer`` if it is a registered normalizer's name; else the error that starts
    with ``expected`` ("Expected `normalizer` to be one of")."""
    if not isinstance(normalizer, str) or normalizer not in NORMALIZERS:
        raise ValueError(f"{expected} {sorted(NORMALIZERS)}, but got {normalizer!r} instead.")
    return normalizer


def _repeat_kv(t: Tensor, groups: int) -> Tensor:
    """(B, H_kv, m, d) -> (B, H_kv * groups, m, d): key/value head i serves query heads
    i * groups ... i * groups + groups - 1 (transformers' ``repeat_kv``)."""
    if groups == 1:
        return t
    B, H_kv, m, d = t.shape
    return t[:, :, None].expand(B, H_kv, groups, m, d).reshape(B, H_kv * groups, m, d)


def _check_4d(t: object, name: str, query: Tensor, key: Tensor, what: str) -> Tensor | None:
    """``t`` if it is None or a tensor of ``what`` dtype ("bool or floating", "floating")
    and shape (B or 1, 1 or H, n, m); else the error naming ``name``."""
    if t is None:
        return None
    ok = isinstance(t, Tensor) and (
        t.is_floating_point() or (what.startswith("bool") and t.dtype == torch.bool)
    )
    if not ok:
        got = f"dtype {t.dtype}" if isinstance(t, Tensor) else type(t).__name__
        raise TypeError(f"Expected `{name}` to be None or a {what} tensor, but got {got} instead.")
    assert isinstance(t, Tensor)
    B, H, n, _ = query.shape
    m = key.shape[2]
    if (
        t.ndim != 4
        or t.shape[0] not in (1, B)
        or t.shape[1] not in (1, H)
        or t.shape[-2:] != (n, m)
    ):
        raise ValueError(
            f"Expected `{name}` of shape (B or 1, 1 or H, n, m) = ({B} or 1, 1 or {H}, {n}, "
            f"{m}), but got {tuple(t.shape)} instead."
        )
    return t


def _pack_heads(t: Tensor | None, H_kv: int, groups: int) -> Tensor | None:
    """A mask or bias (B or 1, 1 or H, 1, m) of a decoding step laid out for the queries
    (B, H_kv, groups, d) that :func:`_build` makes of one query's heads: one shared by the
    heads broadcasts as it is; one per head becomes (B or 1, H_kv, groups, m)."""
    if t is None or t.shape[1] == 1:
        return t
    return t.reshape(t.shape[0], H_kv, groups, t.shape[-1])


def attention_function(normalizer: str = "softmax") -> AttentionFunction:
    """The attention function :func:`register` registers for ``normalizer``.

    The function has the signature of transformers' ``sdpa_attention_forward``::

        fn(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
           is_causal=None, **kwargs) -> (output, weights)

    - ``query`` (B, H, n, d); ``key`` (B, H_kv, m, d) and ``value`` (B, H_kv, m, dv) with
      grouped-query heads (H = H_kv · ``module.num_key_value_groups``, read off the
      shapes; each key/value head serves H / H_kv consecutive query heads). One floating
      dtype and one device for the three (any that attnscore takes; 16-bit inputs are
      normalised in float32).
    - ``attention_mask``: None; bool (B or 1, 1 or H, n, m), **True = may attend**, as
      transformers' ``sdpa_mask`` makes it (the mask function registered with the name);
      or floating of that shape, an additive mask (a custom 4-D mask: 0 where allowed,
      the dtype's lowest value where not), added to the scores as ``"sdpa"`` adds it.
      With None, ``is_causal`` (else ``module.is_causal``, default True) masks causally
      when n > 1, top-left aligned; a single query (KV-cache decoding, m > 1) attends
      every key, as in ``"sdpa"``.
    - ``position_bias`` (keyword; T5 and its kin): None or floating (B or 1, H, n, m),
      added to the scores before the softmax (with a float mask: their sum), as
      ``"sdpa"`` does; gradients reach it.
    - ``scaling``: the factor on ``Q Kᵀ`` (None: 1 / sqrt(d)). ``dropout``: applied to the
      weights only while ``module.training``.
    - Returns ``output`` (B, n, H, dv) (contiguous, in the inputs' dtype) and, when the
      model asks (``output_attentions=True``, which transformers passes down), ``weights``
      (B, H, n, m), taken before dropout, the very tensor the output is computed from (so
      ``weights.retain_grad()`` gets a gradient); else None. Weights at keys a boolean
      mask forbids are exact zeros, each row of a query that may attend some key sums to
      1, and a query that may attend no key (a padded position) gets zero weights and zero
      output, with zero gradient: never NaN. (An additive mask forbids nothing by itself:
      a row that is all the lowest value gets uniform weights, as in ``"sdpa"``.)

    Args:
        normalizer: a name from :func:`attnscore.normalizer_names` (``"softmax"``,
            ``"sparsemax"``, ``"entmax15"``, ``"hardmax"`` or one added with
            :func:`attnscore.register_normalizer`). The same object is returned for the
            same name.

    The returned function refuses what it would get wrong rather than ignore it: a mask
    that is neither bool nor floating, or a ``position_bias`` that is not floating
    (TypeError), either of another shape, H not a multiple of H_kv, and arguments that
    change the maths it does not implement (``softcap``, ``s_aux``, a paged ``cache``:
    ValueError); bad tensors raise what :func:`attnscore.dot_product_attention` raises.

    Raises:
        ValueError: ``normalizer`` is not a registered normalizer's name.

    Source: Vaswani et al. 2017, eq. (1), with the normalizer in place of the softmax;
    transformers' ``integrations/sdpa_attention.py`` for the calling convention.

    >>> import types
    >>> fn = attention_function("softmax")
    >>> module = types.SimpleNamespace(training=False, is_causal=True, num_key_value_groups=2)
    >>> q, kv = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 5, 8)   # decoding: n = 1, m = 5
    >>> keep = torch.tensor([True] * 5 + [False, False, True, True, True]).reshape(2, 1, 1, 5)
    >>> out, weights = fn(module, q, kv, kv, keep, output_attentions=True)
    >>> out.shape, weights.shape
    (torch.Size([2, 1, 4, 8]), torch.Size([2, 4, 1, 5]))
    >>> weights[1, :, 0, :2].abs().sum().item(), weights.sum(-1).allclose(torch.ones(2, 4, 1))
    (0.0, True)
    """
    return _build(_check_normalizer(normalizer, "Expected `normalizer` to be one of"))


@functools.cache
def _build(normalizer: str) -> AttentionFunction:
    """The attention function of a registered ``normalizer`` (one object per name)."""

    def attention_forward(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        for argument, what in _UNSUPPORTED.items():
            if kwargs.get(argument) is not None:
                raise ValueError(
                    f"Expected no `{argument}` for attn_implementation {_name(normalizer)!r}, "
                    f"but got one instead: {what} is not supported; use 'eager'."
                )
        mask = _check_4d(attention_mask, "attention_mask", query, key, "bool or floating")
        position_bias = _check_4d(
            kwargs.get("position_bias"), "position_bias", query, key, "floating"
        )
        # Boolean masks say which keys may be attended (True = may attend); a float mask is
        # additive, as transformers' 4-D custom masks are (0 / the dtype's lowest value):
        # both it and a position bias are added to the scores before the normalizer.
        attend = mask if mask is not None and mask.dtype == torch.bool else None
        bias = None if attend is not None else mask
        if position_bias is not None:
            bias = position_bias if bias is None else position_bias + bias
        B, H, n, _ = query.shape
        H_kv = key.shape[1]
        if H_kv == 0 or H % H_kv:
            raise ValueError(
                "Expected the number of query heads to be a multiple of the key/value heads, "
                f"but got query {tuple(query.shape)} and key {tuple(key.shape)} instead."
            )
        groups = H // H_kv
        causal = getattr(module, "is_causal", True) if is_causal is None else is_causal
        causal = bool(causal) and n > 1 and mask is None  # one query: it sees the cache
        want = bool(kwargs.get("output_attentions"))  # transformers passes it down
        options: dict[str, Any] = {
            "scale": scaling,
            "attend_mask": attend,
            "score_bias": bias,
            "causal": causal,
            "normalizer": normalizer,
            "dropout_p": dropout if getattr(module, "training", False) else 0.0,
        }
        if want:
            # The weights come back as computed, (B, H, n, m): the output is computed from
            # this very tensor, so gradients reach it (no reshaped view off the path).
            q, k, v = query, _repeat_kv(key, groups), _repeat_kv(value, groups)
            out, weights = dot_product_attention(q, k, v, return_weights=True, **options)
        else:
            if n == 1 and groups > 1:
                # Decoding: each key/value head's query heads become its queries (no copy of
                # the cache); a mask or bias shared by the heads broadcasts over them.
                q = query.reshape(B, H_kv, groups, query.shape[-1])
                options["attend_mask"] = _pack_heads(attend, H_kv, groups)
                options["score_bias"] = _pack_heads(bias, H_kv, groups)
                k, v = key, value
            else:
                q, k, v = query, _repeat_kv(key, groups), _repeat_kv(value, groups)
            out, weights = dot_product_attention(q, k, v, **options), None
        out = out.reshape(B, H, n, out.shape[-1]).transpose(1, 2).contiguous()
        return out, weights

    attention_forward.__name__ = f"{_name(normalizer)}_attention_forward"
    attention_forward.__qualname__ = attention_forward.__name__
    attention_forward.__doc__ = (
        f"attnscore's dot-product attention with the {normalizer!r} normalizer, in "
        "transformers' calling convention (see "
        "`attnscore.integrations.transformers.attention_function`)."
    )
    return attention_forward


def register(normalizers: Sequence[str] = DEFAULT_NORMALIZERS) -> list[str]:
    """Register attnscore's attention with transformers; return the names registered.

    ``"attnscore"`` for ``"softmax"`` (what ``"sdpa"`` computes), ``"attnscore_<name>"``
    for any other normalizer. Each name gets :func:`attention_function` of its normalizer
    (``AttentionInterface.register``) and transformers' ``sdpa_mask`` as its mask function
    (``AttentionMaskInterface.register``): boolean masks, True = may attend, or None where
    causal masking alone will do. Registering again is harmless (the same objects are
    registered again). Then::

        model = AutoModelForCausalLM.from_config(config, attn_implementation="attnscore")
        model.set_attn_implementation("attnscore_entmax15")

    Args:
        normalizers: names from :func:`attnscore.normalizer_names`; the default registers
            ``["attnscore", "attnscore_sparsemax", "attnscore_entmax15"]``.

    Returns:
        The registered names, in the order of ``normalizers``.

    Raises:
        ValueError: an entry of ``normalizers`` is not a registered normalizer (nothing is
            registered then).
        ImportError: transformers is not installed (``pip install 'attnscore[hf]'``).

    >>> register()  # doctest: +SKIP
    ['attnscore', 'attnscore_sparsemax', 'attnscore_entmax15']
    """
    if isinstance(normalizers, str):
        normalizers = [normalizers]
    functions = {
        _name(name): attention_function(
            _check_normalizer(name, "Expected `normalizers` to hold names from")
        )
        for name in normalizers
    }
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
        from transformers.masking_utils import sdpa_mask
    except ImportError as err:  # optional dependency
        raise ImportError(
            "attnscore.integrations.transformers needs transformers: pip install 'attnscore[hf]'"
        ) from err
    for name, function in functions.items():
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, sdpa_mask)
    return list(functions)
