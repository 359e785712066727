"""Multi-head attention on the shared pipeline (D2L section "Multi-Head Attention").

Heads are a leading batch dimension: projections are reshaped to (B, H, n, d/H) and any
scorer of the library runs on them once, with ``valid_lens`` broadcast over heads (no
``repeat_interleave`` copy as in the textbook).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ._checks import check_attention_inputs, one_length_each
from ._engine import MASK_NAMES, MaskOptions
from ._habits import check_keywords, refuses_pytorch_keywords
from ._lazy import LazyLinear
from ._projected import project_once
from .kernels._attention import may_hold_garbage
from .masking import build_mask
from .modules import Attention, DotProductAttention, _check_size, make_scorer
from .normalizers import Normalizer
from .registry import scorer_names
from .scoring import default_scale

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, section 3.2.2; D2L "Multi-Head Attention").

    ``head_i = attention(W_q q, W_k k, W_v v)`` restricted to the i-th slice of size
    num_hiddens / num_heads, and ``output = W_o concat(head_1, ..., head_H)``. The
    projections, named as in the textbook, are ``nn.Linear`` with ``query_size`` given, else
    ``nn.LazyLinear`` sized by the first call (as the textbook's) or by ``load_state_dict``
    of a trained checkpoint; both forms have the same ``state_dict`` keys.

    Args:
        num_hiddens: E, the size of the projections and the output, a multiple of ``num_heads``.
        num_heads: H.
        dropout: dropout on the attention weights (training mode only).
        bias: biases in the four projections (``nn.MultiheadAttention``'s default is True).
        scoring: the name of a registered scorer (:func:`attnscore.scorer_names`; default
            ``"scaled_dot"``, which takes the fused fast path where available), built by
            :func:`attnscore.make_scorer` with the head size for every size, or an
            :class:`~attnscore.Attention` instance working on per-head vectors. Names mean
            what the registry says (``"dot"`` is Luong's unscaled product).
        normalizer: the probability function of a scorer built from its name
            (:func:`attnscore.normalizers.normalizer_names` or a callable); an
            :class:`~attnscore.Attention` given as ``scoring`` keeps its own.
        keep_weights: ``"lazy"``, ``"eager"`` or ``"none"``, what
            :attr:`attention_weights` keeps (:class:`~attnscore.Attention`) of a scorer
            built from its name; a given :class:`~attnscore.Attention` keeps its own.
        query_size: q, the queries' feature size (``nn.MultiheadAttention``'s
            ``embed_dim``); None (default) infers all three sizes on the first call.
        key_size: k (default ``query_size``, as ``kdim`` defaults to ``embed_dim``).
        value_size: v (default ``key_size``, as ``vdim``).

    Shapes: ``forward(queries (B, n, q), keys (B, m, k), values (B, m, v), valid_lens=None,
    **masks)`` -> (B, n, E), batch-first always (``nn.MultiheadAttention``'s
    ``batch_first=True``); masks apply to every head (see :meth:`forward`).
    :attr:`attention_weights` is (B, H, n, m), the last call's, before dropout; rows with
    no valid key are zero. :meth:`from_torch` and :meth:`to_torch` convert from and to
    ``nn.MultiheadAttention``.

    Raises:
        ValueError: ``num_hiddens`` not a multiple of ``num_heads``, sizes that are not
            positive ints, unknown ``scoring``; in ``forward``, as
            :class:`~attnscore.Attention`.
        TypeError: a keyword it does not take; for ``nn.MultiheadAttention``'s (e.g.
            ``embed_dim``, ``kdim``, ``batch_first``), naming attnscore's equivalent.

    >>> mha = MultiHeadAttention(num_hiddens=8, num_heads=2).eval()
    >>> x = torch.randn(3, 4, 5)
    >>> mha(x, x, x, torch.tensor([4, 2, 1])).shape
    torch.Size([3, 4, 8])
    >>> mha.attention_weights.shape
    torch.Size([3, 2, 4, 4])
    >>> MultiHeadAttention(8, 2, query_size=5).W_q  # sized up front
    Linear(in_features=5, out_features=8, bias=False)
    """

    @refuses_pytorch_keywords("MultiHeadAttention")
    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        scoring: str | Attention = "scaled_dot",
        *,
        normalizer: str | Normalizer = "softmax",
        keep_weights: str = "lazy",
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
    ) -> None:
        super().__init__()
        inputs = {"query_size": query_size, "key_size": key_size, "value_size": value_size}
        for name, size in {"num_hiddens": num_hiddens, "num_heads": num_heads, **inputs}.items():
            _check_size(size, name, optional=name in inputs)
        if num_hiddens % num_heads:
            raise ValueError(
                f"Expected `num_hiddens` to be a multiple of `num_heads` ({num_heads}), but got "
                f"{num_hiddens} instead."
            )
        self.num_heads = num_heads
        size = num_hiddens // num_heads  # every size of a scorer built by name
        if isinstance(scoring, Attention):
            self.attention = scoring
        elif isinstance(scoring, str) and scoring in scorer_names():
            self.attention = make_scorer(
                scoring, size, size, num_hiddens=size, dropout=dropout, normalizer=normalizer,
                keep_weights=keep_weights,
            )  # fmt: skip
        else:
            raise ValueError(
                f"Expected `scoring` to be one of {scorer_names()} or an Attention module, "
                f"but got {scoring!r} instead."
            )
        key_size = query_size if key_size is None else key_size
        value_size = key_size if value_size is None else value_size
        self.W_q = _projection(query_size, num_hiddens, bias)
        self.W_k = _projection(key_size, num_hiddens, bias)
        self.W_v = _projection(value_size, num_hiddens, bias)
        self.W_o = _projection(None if query_size is None else num_hiddens, num_hiddens, bias)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention) -> MultiHeadAttention:
        """The ``MultiHeadAttention`` that computes what ``module`` does.

        Its weights and biases (copies, on the module's device and dtype), head count,
        dropout, sizes (``embed_dim`` is ``num_hiddens`` and ``query_size``, ``kdim``
        ``key_size``, ``vdim`` ``value_size``) and training mode, scored by
        ``"scaled_dot"``. Inputs are batch-first here whatever ``module.batch_first``: for
        a ``batch_first=False`` module, transpose (n, B, E) inputs to (B, n, E). Masks
        carry over with their polarity turned: ``key_padding_mask`` (True = ignore) is
        ``attend_mask=~key_padding_mask[:, None, :]`` or lengths ``valid_lens``, a bool
        ``attn_mask`` (True = not allowed) is ``attend_mask=~attn_mask``, and
        ``need_weights=True, average_attn_weights=False`` is ``return_weights=True``.

        Args:
            module: a ``torch.nn.MultiheadAttention`` without ``add_bias_kv`` and ``add_zero_attn``.

        Returns:
            A new :class:`MultiHeadAttention`; ``module`` is unchanged.

        Raises:
            TypeError: ``module`` is not an ``nn.MultiheadAttention``.
            ValueError: ``module`` has ``add_bias_kv`` or ``add_zero_attn`` (no equivalent here).

        >>> theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True).eval()
        >>> ours = MultiHeadAttention.from_torch(theirs)
        >>> x = torch.randn(3, 4, 8)
        >>> torch.allclose(ours(x, x, x), theirs(x, x, x)[0], atol=1e-6)
        True
        """
        if not isinstance(module, nn.MultiheadAttention):
            raise TypeError(
                "Expected `module` to be a torch.nn.MultiheadAttention, but got "
                f"{type(module).__name__} instead."
            )
        for option, used in (
            ("add_bias_kv", module.bias_k is not None),
            ("add_zero_attn", module.add_zero_attn),
        ):
            if used:
                raise ValueError(
                    f"Expected `module` built without {option} (attnscore has no "
                    f"equivalent), but got one with {option}=True instead."
                )
        E = module.embed_dim
        if module.in_proj_weight is not None:  # one (3E, E) matrix: kdim == vdim == E
            w_q, w_k, w_v = module.in_proj_weight.split(E)
        else:
            w_q, w_k, w_v = module.q_proj_weight, module.k_proj_weight, module.v_proj_weight
        biases: list[Tensor | None] = [None] * 4
        if module.in_proj_bias is not None:
            biases = [*module.in_proj_bias.split(E), module.out_proj.bias]
        ours = cls(
            E,
            module.num_heads,
            module.dropout,
            bias=module.in_proj_bias is not None,
            query_size=E,
            key_size=module.kdim,
            value_size=module.vdim,
        ).to(device=w_q.device, dtype=w_q.dtype)
        linears = (ours.W_q, ours.W_k, ours.W_v, ours.W_o)
        weights = (w_q, w_k, w_v, module.out_proj.weight)
        with torch.no_grad():
            for linear, weight, b in zip(linears, weights, biases, strict=True):
                linear.weight.copy_(weight)
                if b is not None:
                    linear.bias.copy_(b)
        return ours.train(module.training)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """The ``torch.nn.MultiheadAttention`` that computes what this module does.

        Its weights and biases (copies, on this module's device and dtype), head count,
        dropout, sizes and training mode. Only what ``nn.MultiheadAttention`` computes
        converts: scaled dot-product scores with the softmax, queries of ``num_hiddens``
        features, biases in all four projections or in none.

        Args:
            batch_first: the returned module's layout: True (default) takes (B, n, E) as
                this module does; False takes (n, B, E).

        Returns:
            A new ``nn.MultiheadAttention``; this module is unchanged.

        Raises:
            ValueError: another scorer, scale or normalizer than scaled dot product with the
                softmax; projections not sized yet (a lazy module before its first call);
                a query size other than ``num_hiddens``; biases in some projections only.

        >>> ours = MultiHeadAttention(8, 2, bias=True, query_size=8).eval()
        >>> theirs = ours.to_torch()
        >>> x = torch.randn(3, 4, 8)
        >>> torch.allclose(theirs(x, x, x)[0], ours(x, x, x), atol=1e-6)
        True
        """
        attention = self.attention
        scaled = type(attention) is DotProductAttention and attention.scale in (
            None,
            default_scale(int(self.W_o.out_features) // self.num_heads),
        )
        if not scaled or attention.normalizer != "softmax":
            raise ValueError(
                "Expected a MultiHeadAttention scored by 'scaled_dot' with the softmax (what "
                f"nn.MultiheadAttention computes), but got {attention!r} instead."
            )
        linears = (self.W_q, self.W_k, self.W_v, self.W_o)
        if any(isinstance(linear, nn.LazyLinear) for linear in linears):
            raise ValueError(
                "Expected projections of known sizes, but got a lazy module instead: build "
                "it with `query_size=...` or call it once first."
            )
        E = self.W_o.weight.shape[0]
        if self.W_q.weight.shape[1] != E:
            raise ValueError(
                f"Expected queries of num_hiddens={E} features (nn.MultiheadAttention's "
                f"embed_dim), but got query_size={self.W_q.weight.shape[1]} instead."
            )
        names = ("W_q", "W_k", "W_v", "W_o")
        biased = [name for name, lin in zip(names, linears, strict=True) if lin.bias is not None]
        if biased and len(biased) < len(names):
            raise ValueError(
                "Expected biases in all four projections or in none, but got them in "
                f"{biased} only instead."
            )
        weight = self.W_o.weight
        theirs = nn.MultiheadAttention(
            E,
            self.num_heads,
            dropout=attention.dropout.p,
            bias=bool(biased),
            kdim=self.W_k.weight.shape[1],
            vdim=self.W_v.weight.shape[1],
            batch_first=batch_first,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            weights = [linear.weight for linear in linears[:3]]
            if theirs.in_proj_weight is not None:
                theirs.in_proj_weight.copy_(torch.cat(weights))
            else:
                separate = (theirs.q_proj_weight, theirs.k_proj_weight, theirs.v_proj_weight)
                for mine, w in zip(separate, weights, strict=True):
                    mine.copy_(w)
            theirs.out_proj.weight.copy_(self.W_o.weight)
            if biased:
                theirs.in_proj_bias.copy_(torch.cat([linear.bias for linear in linears[:3]]))
                theirs.out_proj.bias.copy_(self.W_o.bias)
        return theirs.train(self.training)

    def _split_heads(self, x: Tensor) -> Tensor:
        """(B, n, E) -> (B, H, n, E/H)."""
        heads: Tensor = x.unflatten(-1, (self.num_heads, -1))
        return heads.transpose(1, 2)

    # The signature of Attention.forward, on purpose: MultiHeadAttention takes every mask a
    # single-head module does (`duplicates` pairs the two).
    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor | None = None,
        *,
        return_weights: bool = False,
        **masks: Unpack[MaskOptions],
    ) -> Tensor | tuple[Tensor, Tensor]:
        """Multi-head attention of queries over keys and values.

        Args:
            queries: (B, n, q) floating. keys: (B, m, k). values: (B, m, v); one dtype and
                device for all three (sizes q, k, v inferred on the first call).
            valid_lens: key lengths (B,) or (B, n), shared by every head; int or
                whole-number float; or one ``int`` for every example; lengths above m
                mean all keys.
            return_weights: also return the weights, which carry gradients.
            **masks: ``query_valid_lens`` (B,): queries beyond them give zero attention
                output (before ``W_o``); ``attend_mask``: bool, True = may attend, (n, m),
                (B, n, m) or (B, H, n, m); ``causal``: query i attends keys j <= i only.

        Returns:
            (B, n, E) with E = ``num_hiddens``, in the inputs' dtype; queries with no valid
            key get zero attention output (their result is ``W_o``'s bias, 0 without bias).
            With ``return_weights=True``, ``(output, weights)``: the per-head weights
            (B, H, n, m) with gradients (``nn.MultiheadAttention``'s ``need_weights=True,
            average_attn_weights=False``); :attr:`attention_weights` holds them either way.

        Raises:
            TypeError, ValueError: as :func:`attnscore.attention`; also queries that are not 3-D.
        """
        if masks:
            check_keywords(masks, MASK_NAMES, "multihead forward")
        check_attention_inputs(queries, keys, values)
        if queries.ndim != 3:
            raise ValueError(
                "Expected `queries` of shape (B, n, q) for multi-head attention, but got shape "
                f"{tuple(queries.shape)} instead."
            )
        self._check_sizes(queries, keys, values)
        valid_lens = one_length_each(valid_lens, queries)
        attend_mask = masks.get("attend_mask")
        if isinstance(attend_mask, Tensor) and attend_mask.ndim == 3:
            masks = {**masks, "attend_mask": attend_mask.unsqueeze(1)}  # (B, n, m): all heads
        keys, values = self._inert_padding(queries, keys, values, valid_lens, masks)
        projected_keys, projected_values = self._memory(queries, keys, values)
        heads = self.attention(
            self._split_heads(self.W_q(queries)),
            self._split_heads(projected_keys),
            self._split_heads(projected_values),
            valid_lens,
            return_weights=return_weights,
            **masks,
        )
        if return_weights:
            heads, weights = heads
            return self.W_o(heads.transpose(1, 2).flatten(-2)), weights
        output: Tensor = self.W_o(heads.transpose(1, 2).flatten(-2))
        return output

    def _inert_padding(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor | None,
        masks: MaskOptions,
    ) -> tuple[Tensor, Tensor]:
        """Keys and values with the rows no query of any head attends zeroed where some row
        may hold NaN or inf (:func:`~attnscore.kernels._attention.may_hold_garbage`), in
        calls that compute gradients: the projections' weight gradients sum over every row,
        and 0 x NaN is NaN. Without gradients the projected padding is the attention's own
        (its padding, inert there): nothing to read or zero here."""
        if valid_lens is None and not masks:
            return keys, values
        if not torch.is_grad_enabled() or not (
            keys.requires_grad
            or values.requires_grad
            or any(p.requires_grad for p in (*self.W_k.parameters(), *self.W_v.parameters()))
        ):
            return keys, values
        if not may_hold_garbage(keys, values):
            return keys, values
        B, n, m = queries.shape[0], queries.shape[1], keys.shape[1]
        attend = masks.get("attend_mask")
        heads = attend.shape[1] if isinstance(attend, Tensor) and attend.ndim == 4 else 1
        mask = build_mask(
            torch.Size([B, heads]), n, m, queries.device, valid_lens=valid_lens, **masks
        )
        padded = mask.padded_keys()
        if padded is None:
            return keys, values
        rows = (
            padded.expand(B, heads, m).all(1).unsqueeze(-1) if padded.ndim > 1 else padded[:, None]
        )
        return keys.masked_fill(rows, 0.0), values.masked_fill(rows, 0.0)

    def _memory(self, queries: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
        """``W_k keys`` and ``W_v values``, computed once for the memory a decoder attends
        at every step (cross-attention: keys that are not the queries), each reused while
        it comes back unchanged (:func:`~attnscore._projected.project_once`). Nothing is kept
        for self-attention (new keys at every step)."""
        if keys is queries:
            self.__dict__["_keys_cache"] = self.__dict__["_values_cache"] = None
            return self.W_k(keys), self.W_v(values)
        return (
            project_once(self, "_keys_cache", self.W_k, keys),
            project_once(self, "_values_cache", self.W_v, values),
        )

    def __getstate__(self) -> dict[str, object]:
        state = self.__dict__.copy()
        # weak references: not picklable, and only a cache
        state["_keys_cache"] = state["_values_cache"] = None
        return state

    def _check_sizes(self, queries: Tensor, keys: Tensor, values: Tensor) -> None:
        """Name the input whose feature size or dtype is not the projections' (given at
        construction, or fixed by the first call or a loaded checkpoint), rather than fail
        inside a matrix product."""
        for name, x, linear in (
            ("queries", queries, self.W_q),
            ("keys", keys, self.W_k),
            ("values", values, self.W_v),
        ):
            if isinstance(linear, nn.LazyLinear) and linear.has_uninitialized_params():
                continue
            size = linear.weight.shape[1]
            if x.shape[-1] != size:
                raise ValueError(
                    f"Expected `{name}` with last dimension {size} (the projection's input "
                    f"size), but got shape {tuple(x.shape)} instead."
                )
        dtype = self.W_q.weight.dtype
        if queries.dtype != dtype and not torch.is_autocast_enabled(queries.device.type):
            raise TypeError(
                f"Expected `queries`, `keys` and `values` of the module's dtype {dtype}, but "
                f"got {queries.dtype} instead: convert the module with `.to({queries.dtype})` "
                f"or the inputs with `.to({dtype})`."
            )

    @property
    def attention_weights(self) -> Tensor | None:
        """Per-head weights (B, H, n, m) of the last call, before dropout; None before (and
        while a call runs: with threads, see :attr:`attnscore.Attention.attention_weights`)."""
        return self.attention.attention_weights


def _projection(in_features: int | None, out_features: int, bias: bool) -> nn.Linear:
    """``nn.Linear(in_features, out_features)``, or a lazy one sized by the first call (or
    a loaded checkpoint) where ``in_features`` is None."""
    if in_features is None:
        return LazyLinear(out_features, bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)
