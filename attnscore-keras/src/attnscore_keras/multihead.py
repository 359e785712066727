"""Multi-head attention over any of the scorers' layers (D2L "Multi-Head Attention")."""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from ._checks import check_attention_inputs, check_dropout, check_normalizer, check_size, shape_of
from .layers import SCORER_NAMES, Attention, make_scorer
from .masking import build_allowed, project_used, used_rows, zero_unused

__all__ = ["MultiHeadAttention"]


@keras.saving.register_keras_serializable(package="attnscore_keras")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention (Vaswani et al. 2017, section 3.2.2; D2L "Multi-Head Attention").

    ``head_i = attention(q W_q, k W_k, v W_v)`` on the i-th slice of size E / H, and
    ``output = concat(head_1, ..., head_H) W_o``. Weights ``W_q`` (q, E), ``W_k`` (k, E),
    ``W_v`` (v, E), ``W_o`` (E, E) (Keras's (in, out) layout: the transposes of the
    PyTorch module's ``nn.Linear`` weights) and with ``bias`` ``b_q``, ``b_k``, ``b_v``,
    ``b_o`` (E,); a scorer with weights (additive, general, cosine) holds its own, shared by
    the heads.

    Args:
        num_hiddens: E, the size of the projections and the output, a multiple of H.
        num_heads: H.
        dropout: dropout on the attention weights (training calls only).
        bias: biases in the four projections.
        scoring: a scorer's name (``"scaled_dot"`` (default), ``"dot"``, ``"additive"``,
            ``"general"``, ``"cosine"``), built with the head size E / H for every size, or
            an attention layer of this package working on per-head vectors.
        normalizer: ``"softmax"``.
        query_size, key_size, value_size: q, k (default q), v (default k); None takes
            them from the first call.
        **kwargs: ``keras.layers.Layer``'s.

    ``call(queries (B, n, q), keys (B, m, k), values (B, m, v), valid_lens=None, *,
    query_valid_lens=None, attend_mask=None, causal=False, training=None)`` -> (B, n, E).
    Masks apply to every head: ``valid_lens`` (B,) or (B, n); ``query_valid_lens`` (B,);
    ``attend_mask`` bool (n, m), (B, n, m) or (B, H, n, m), True = may attend. Queries that
    may attend no key get a zero attention output (their result is ``b_o``, 0 without
    bias). :attr:`attention_weights` is (B, H, n, m), the last eager call's. NaN or inf in
    key and value rows no query attends reaches no output and no gradient: those rows are
    projected as they are, their heads zeroed, and the projection weights' gradients take
    them as zeros (masked calls have custom gradients: reverse mode only).

    Raises:
        ValueError: ``num_hiddens`` not a multiple of ``num_heads``, sizes that are not
            positive ints, an unknown ``scoring``; in ``call``, as
            :meth:`attnscore_keras.Attention.call`, and queries that are not 3-D.

    >>> import numpy as np
    >>> mha = MultiHeadAttention(num_hiddens=8, num_heads=2)
    >>> x = np.random.default_rng(0).normal(size=(3, 4, 5)).astype("float32")
    >>> tuple(mha(x, x, x, np.array([4, 2, 1])).shape)
    (3, 4, 8)
    >>> tuple(mha.attention_weights.shape)
    (3, 2, 4, 4)
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = False,
        scoring: str | Attention = "scaled_dot",
        *,
        normalizer: str = "softmax",
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        **kwargs: Any,
    ):
        super().__init__(**kwargs)
        self.num_hiddens = check_size(num_hiddens, "num_hiddens")
        self.num_heads = check_size(num_heads, "num_heads")
        if num_hiddens % num_heads:
            raise ValueError(
                f"Expected `num_hiddens` to be a multiple of `num_heads` ({num_heads}), but got "
                f"{num_hiddens} instead."
            )
        self.dropout_rate = check_dropout(dropout)
        self.normalizer = check_normalizer(normalizer)
        self.use_bias = bool(bias)
        self.query_size = check_size(query_size, "query_size", optional=True)
        key_size = check_size(key_size, "key_size", optional=True)
        value_size = check_size(value_size, "value_size", optional=True)
        self.key_size = self.query_size if key_size is None else key_size
        self.value_size = self.key_size if value_size is None else value_size
        size = num_hiddens // num_heads
        if isinstance(scoring, Attention):
            self.scoring = None
            self.attention = scoring
        elif isinstance(scoring, str) and scoring in SCORER_NAMES:
            self.scoring = scoring
            self.attention = make_scorer(
                scoring, size, self.dropout_rate, self.normalizer, self.dtype_policy
            )
        else:
            raise ValueError(
                f"Expected `scoring` to be one of {SCORER_NAMES} or an attention layer, but "
                f"got {scoring!r} instead."
            )

    def build(self, queries_shape: Any, keys_shape: Any = None, values_shape: Any = None) -> None:
        """Make ``W_q`` (q, E), ``W_k`` (k, E), ``W_v`` (v, E), ``W_o`` (E, E) (and the
        biases), sized by the constructor's arguments or the shapes, and the scorer's
        weights for heads of size E / H."""
        keys_shape = keys_shape or queries_shape
        values_shape = values_shape or keys_shape
        q = self.query_size or int(queries_shape[-1])
        k = (self.key_size if self.query_size else None) or int(keys_shape[-1])
        v = (self.value_size if self.query_size else None) or int(values_shape[-1])
        self.query_size, self.key_size, self.value_size = q, k, v
        E = self.num_hiddens
        for name, rows in (("W_q", q), ("W_k", k), ("W_v", v), ("W_o", E)):
            setattr(self, name, self.add_weight(name=name, shape=(rows, E)))
            bias = f"b_{name[-1]}"
            if self.use_bias:
                setattr(self, bias, self.add_weight(name=bias, shape=(E,), initializer="zeros"))
            else:
                setattr(self, bias, None)
        d = E // self.num_heads
        if not self.attention.built:
            head = (None, self.num_heads, None, d)
            self.attention.build(head, head, head)

    def _project(self, x: Any, weight: Any, bias: Any) -> Any:
        """``x @ weight [+ bias]``."""
        y = ops.matmul(x, weight)
        return y if bias is None else y + bias

    def call(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        valid_lens: Any = None,
        *,
        query_valid_lens: Any = None,
        attend_mask: Any = None,
        causal: bool = False,
        training: Any = None,
    ) -> Any:
        """Multi-head attention of queries over keys and values.

        Args:
            queries: (B, n, q) floating. keys: (B, m, k). values: (B, m, v); one dtype.
            valid_lens: key lengths (B,) or (B, n), shared by every head.
            query_valid_lens: (B,): later queries get a zero attention output.
            attend_mask: bool (n, m), (B, n, m) or (B, H, n, m), True = may attend.
            causal: query i attends keys j <= i only.
            training: dropout on the weights in training calls only.

        Returns:
            (B, n, E) in the inputs' dtype.

        Raises:
            TypeError: non-floating inputs or mixed dtypes; masks of the wrong dtype.
            ValueError: queries that are not 3-D; feature sizes unlike the weights';
                masks of the wrong shape; negative or fractional lengths (eager calls).
        """
        queries, keys, values = check_attention_inputs(
            queries, keys, values, same_feature_size=False
        )
        if len(queries.shape) != 3:
            raise ValueError(
                "Expected `queries` of shape (B, n, q) for multi-head attention, but got shape "
                f"{shape_of(queries)} instead."
            )
        for name, x, size in (
            ("queries", queries, self.query_size),
            ("keys", keys, self.key_size),
            ("values", values, self.value_size),
        ):
            if self.built and x.shape[-1] is not None and x.shape[-1] != size:
                raise ValueError(
                    f"Expected `{name}` with last dimension {size} (the projection's input "
                    f"size), but got shape {shape_of(x)} instead."
                )
        B, n = shape_of(queries)[:2]
        m = shape_of(keys)[1]
        H = self.num_heads
        dyn_q, dyn_k = ops.shape(queries), ops.shape(keys)
        if attend_mask is not None and len(getattr(attend_mask, "shape", ())) == 3:
            attend_mask = ops.expand_dims(attend_mask, 1)  # (B, n, m): every head
        allowed = build_allowed(
            (B, H, n, m),
            (dyn_q[0], H, dyn_q[1], dyn_k[1]),
            valid_lens=valid_lens,
            query_valid_lens=query_valid_lens,
            attend_mask=attend_mask,
            causal=causal,
        )
        if allowed is None:
            k_heads = self._split(self._project(keys, self.W_k, self.b_k))
            v_heads = self._split(self._project(values, self.W_v, self.b_v))
        else:
            if query_valid_lens is not None:  # queries that attend nothing: zero rows
                queries = zero_unused(allowed, 2, queries, axis=-1)
            # The key and value rows no query attends may hold NaN or inf (0 x NaN is
            # NaN). They are projected as they are and their heads zeroed: that select
            # fuses into the copy that splits the heads, where zeroing the inputs is a
            # pass over each (two XLA ops at a decoder step). The weights' gradients
            # take those input rows as zeros (:func:`project_used`).
            used = used_rows(allowed, 2, keys, axis=-2)  # (B, m, 1)
            k_heads, v_heads = (
                zero_unused(
                    allowed,
                    2,
                    self._split(project_used(x, self._weight(w), self._weight(b), used)),
                    axis=-2,
                )
                for x, w, b in ((keys, self.W_k, self.b_k), (values, self.W_v, self.b_v))
            )
        heads = self.attention.pool(
            self._split(self._project(queries, self.W_q, self.b_q)),
            k_heads,
            v_heads,
            allowed,
            training,
        )
        merged = ops.reshape(ops.transpose(heads, (0, 2, 1, 3)), (-1, dyn_q[1], self.num_hiddens))
        return self._project(merged, self.W_o, self.b_o)

    @staticmethod
    def _weight(w: Any) -> Any:
        """A weight (or None) as a tensor, an argument of a custom-gradient op: a copy,
        because TensorFlow's custom gradients take a variable read inside them (its
        conversion to a tensor is still the variable) as needing their own protocol.
        Compiled, the copy is no op."""
        return None if w is None else ops.copy(w)

    def _split(self, x: Any) -> Any:
        """(B, n, E) -> (B, H, n, E/H)."""
        shape = ops.shape(x)
        heads = ops.reshape(x, (shape[0], shape[1], self.num_heads, -1))
        return ops.transpose(heads, (0, 2, 1, 3))

    @property
    def attention_weights(self) -> Any:
        """Per-head weights (B, H, n, m) of the last call, before dropout; None before."""
        return self.attention.attention_weights

    def compute_output_shape(
        self, queries_shape: Any, keys_shape: Any = None, values_shape: Any = None
    ) -> tuple[Any, ...]:
        """(B, n, E) for queries (B, n, q)."""
        return (*tuple(queries_shape)[:-1], self.num_hiddens)

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments (a scorer layer serialised), for ``from_config``."""
        config: dict[str, Any] = super().get_config()
        scoring: Any = self.scoring
        if scoring is None:
            scoring = keras.saving.serialize_keras_object(self.attention)
        config.update(
            num_hiddens=self.num_hiddens,
            num_heads=self.num_heads,
            dropout=self.dropout_rate,
            bias=self.use_bias,
            scoring=scoring,
            normalizer=self.normalizer,
            query_size=self.query_size,
            key_size=self.key_size,
            value_size=self.value_size,
        )
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> MultiHeadAttention:
        """The layer of :meth:`get_config`'s ``config`` (a serialised scorer rebuilt)."""
        config = dict(config)
        if isinstance(config.get("scoring"), dict):
            config["scoring"] = keras.saving.deserialize_keras_object(config["scoring"])
        return cls(**config)
