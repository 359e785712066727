"""Multi-head attention on the shared pipeline (D2L section "Multi-Head Attention").

Heads are a leading batch dimension: projections are reshaped to (B, H, n, d/H) and any
scorer of the library runs on them once, with ``valid_lens`` broadcast over heads (no
``repeat_interleave`` copy as in the textbook).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from typing_extensions import Unpack

from ._checks import check_attention_inputs
from ._engine import MaskOptions
from .kernels._attention import may_hold_garbage
from .masking import build_mask
from .modules import Attention, make_scorer
from .normalizers import Normalizer
from .registry import scorer_names

__all__ = ["MultiHeadAttention"]


class MultiHeadAttention(nn.Module):
    """Multi-head attention (Vaswani et al. 2017, section 3.2.2; D2L "Multi-Head Attention").

    ``head_i = attention(W_q q, W_k k, W_v v)`` restricted to the i-th slice of size
    num_hiddens / num_heads, and ``output = W_o concat(head_1, ..., head_H)``. Projections
    are ``nn.LazyLinear`` (input sizes inferred on the first call), named as in the
    textbook (``W_q``, ``W_k``, ``W_v``, ``W_o``).

    Args:
        num_hiddens: model size E, a multiple of ``num_heads``.
        num_heads: H.
        dropout: dropout on the attention weights (training mode only).
        bias: biases in the four projections.
        scoring: the name of a registered scorer (:func:`attnscore.scorer_names`; default
            ``"scaled_dot"``, which takes the fused fast path where available), built by
            :func:`attnscore.make_scorer` with the head size for every size, or an
            :class:`~attnscore.Attention` instance working on per-head vectors. Names mean
            what the registry says (``"dot"`` is Luong's unscaled product).
        normalizer: the probability function of a scorer built from its name
            (:func:`attnscore.normalizers.normalizer_names` or a callable); an
            :class:`~attnscore.Attention` given as ``scoring`` keeps its own.

    Shapes: ``forward(queries (B, n, q), keys (B, m, k), values (B, m, v), valid_lens=None,
    **masks)`` -> (B, n, E).
    ``valid_lens`` (B,) or (B, n) applies to every head; ``attend_mask`` (bool, True = may
    attend) may be (n, m), (B, n, m) or (B, H, n, m). :attr:`attention_weights` is
    (B, H, n, m), the last call's, before dropout; rows with no valid key are zero.

    Raises:
        ValueError: ``num_hiddens`` not a multiple of ``num_heads``, unknown ``scoring``;
            in ``forward``, as :class:`~attnscore.Attention`.

    >>> mha = MultiHeadAttention(num_hiddens=8, num_heads=2).eval()
    >>> x = torch.randn(3, 4, 5)
    >>> mha(x, x, x, torch.tensor([4, 2, 1])).shape
    torch.Size([3, 4, 8])
    >>> mha.attention_weights.shape
    torch.Size([3, 2, 4, 4])
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        scoring: str | Attention = "scaled_dot",
        *,
        normalizer: str | Normalizer = "softmax",
    ) -> None:
        super().__init__()
        for name, value in (("num_hiddens", num_hiddens), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"Expected `{name}` to be a positive int, but got {value!r} instead."
                )
        if num_hiddens % num_heads:
            raise ValueError(
                f"Expected `num_hiddens` to be a multiple of `num_heads` ({num_heads}), but got "
                f"{num_hiddens} instead."
            )
        self.num_heads = num_heads
        head_size = num_hiddens // num_heads
        if isinstance(scoring, Attention):
            self.attention = scoring
        elif isinstance(scoring, str) and scoring in scorer_names():
            self.attention = make_scorer(
                scoring,
                head_size,
                head_size,
                num_hiddens=head_size,
                dropout=dropout,
                normalizer=normalizer,
            )
        else:
            raise ValueError(
                f"Expected `scoring` to be one of {scorer_names()} or an Attention module, "
                f"but got {scoring!r} instead."
            )
        self.W_q = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_k = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_v = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_o = nn.LazyLinear(num_hiddens, bias=bias)

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
                whole-number float; lengths above m mean all keys.
            return_weights: also return the weights, which carry gradients.
            **masks: ``query_valid_lens`` (B,): queries beyond them give zero attention
                output (before ``W_o``); ``attend_mask``: bool, True = may attend, (n, m),
                (B, n, m) or (B, H, n, m); ``causal``: query i attends keys j <= i only.

        Returns:
            (B, n, E) with E = ``num_hiddens``, in the inputs' dtype. Queries with no valid
            key get zero attention output, so their result is ``W_o``'s bias (0 without
            bias). :attr:`attention_weights` then holds (B, H, n, m). With
            ``return_weights=True``, ``(output, weights)``: the per-head weights
            (B, H, n, m) with their gradients (``nn.MultiheadAttention``'s
            ``need_weights=True, average_attn_weights=False``).

        Raises:
            TypeError, ValueError: as :func:`attnscore.attention`; also queries that are not
            3-D.
        """
        check_attention_inputs(queries, keys, values)
        if queries.ndim != 3:
            raise ValueError(
                "Expected `queries` of shape (B, n, q) for multi-head attention, but got shape "
                f"{tuple(queries.shape)} instead."
            )
        self._check_sizes(queries, keys, values)
        attend_mask = masks.get("attend_mask")
        if isinstance(attend_mask, Tensor) and attend_mask.ndim == 3:
            masks = {**masks, "attend_mask": attend_mask.unsqueeze(1)}  # (B, n, m): all heads
        keys, values = self._inert_padding(queries, keys, values, valid_lens, masks)
        heads = self.attention(
            self._split_heads(self.W_q(queries)),
            self._split_heads(self.W_k(keys)),
            self._split_heads(self.W_v(values)),
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
        may hold NaN or inf (:func:`~attnscore.kernels._attention.may_hold_garbage`): the
        projections' weight gradients sum over every row, and 0 x NaN is NaN. The attention
        itself makes its own padding inert."""
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

    def _check_sizes(self, queries: Tensor, keys: Tensor, values: Tensor) -> None:
        """Name the input whose feature size or dtype is not the projections' (fixed by the
        first call: they are lazy), rather than fail inside a matrix product."""
        for name, x, linear in (
            ("queries", queries, self.W_q),
            ("keys", keys, self.W_k),
            ("values", values, self.W_v),
        ):
            if isinstance(linear, nn.LazyLinear) and linear.has_uninitialized_params():
                continue
            if x.shape[-1] != linear.in_features:
                raise ValueError(
                    f"Expected `{name}` with last dimension {linear.in_features} (fixed by the "
                    f"first call), but got shape {tuple(x.shape)} instead."
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
        """Per-head weights (B, H, n, m) of the last call, before dropout; None before."""
        return self.attention.attention_weights
