"""The scorers' attention layers: additive, dot-product, general and cosine attention.

Each layer is a ``keras.layers.Layer`` with the constructor arguments of attnscore's
PyTorch module of the same name, and one pooling path (:meth:`Attention.pool`) shared by
every scorer: masks -> scores -> masked softmax -> dropout -> weights @ values. Shapes: B
batch, n queries, m keys, q / k feature sizes, v value size, h hidden units; leading
dimensions (...) are (B,) or (B, H).
"""

from __future__ import annotations

import math
from typing import Any

import keras
from keras import ops

from ._checks import (
    SIXTEEN_BITS,
    check_attention_inputs,
    check_dropout,
    check_normalizer,
    check_size,
    dtype_of,
    shape_of,
)
from .masking import (
    build_allowed,
    checked_attention,
    checked_pool,
    checked_product,
    fill_softmax,
    filled_scores,
    normalised_pool,
    softmax_where,
    unrolled_attention,
    used_rows,
    zero_unused,
)

__all__ = [
    "AdditiveAttention",
    "Attention",
    "CosineAttention",
    "DotProductAttention",
    "MultiplicativeAttention",
]

_PACKAGE = "attnscore_keras"

# Calls with at most this many queries (static n) check for NaN or inf in the rows of the
# keys and values no query attends instead of zeroing those rows: see Attention.call.
CHECKED_MAX_QUERIES = 16

# Compiled JAX calls of DotProductAttention with one query and at most this many keys
# leave the unattended rows out term by term instead of checking the products: see
# DotProductAttention._pool_checked.
UNROLLED_MAX_KEYS = 48


# The backends on which many-query DotProductAttention calls whose mask has one row for
# every query build their scores with masking.filled_scores (the key rows zeroed, FILL
# added) rather than a select: see DotProductAttention._pool_zeroed.
FILLED_SCORES_BACKENDS = ("jax",)


def staged() -> bool:
    """Whether this call is being traced into one XLA program by ``jax.jit`` (where a new
    constant is a tracer too; under an eager ``jax.grad`` it is not). False on the other
    backends: TensorFlow runs the ops of a ``tf.function`` without ``jit_compile`` one by
    one, and gives no public way to tell the two apart."""
    if keras.backend.backend() != "jax":
        return False
    import jax  # the JAX backend is running: jax is there

    return isinstance(ops.zeros(()), jax.core.Tracer)


class Attention(keras.layers.Layer):
    """The pooling every scorer shares: ``dropout(masked_softmax(score(q, k))) @ values``.

    A base class: subclasses define :meth:`score` (and their weights in ``build``).

    ``call(queries, keys, values, valid_lens=None, *, query_valid_lens=None,
    attend_mask=None, causal=False, training=None)``: queries (..., n, q), keys (..., m, k),
    values (..., m, v) -> output (..., n, v), in the inputs' dtype (the layer's compute
    dtype: Keras casts floating inputs to it).

    Masks (every kind, combined): ``valid_lens`` (B,), (B, n) or (..., n): query i attends
    keys j < length (lengths above m mean all); ``query_valid_lens`` (B,) or (...,):
    queries at or beyond it attend nothing; ``attend_mask`` bool broadcastable to
    (..., n, m), **True = may attend**; ``causal=True``: query i attends keys j <= i.
    A query that may attend no key gets exactly zero weights and a zero output (zero
    gradient); whatever masked rows of the inputs hold (even NaN) reaches no output and no
    gradient. float16 and bfloat16 are reduced in float32 in the softmax. With at most
    ``CHECKED_MAX_QUERIES`` (16) queries the unattended key and value rows are not copied
    with zeros; a product that is not all finite is redone with them zeroed (so a call
    whose inputs hold NaN or inf takes longer, with the same result; a
    :class:`DotProductAttention` call with one query compiled by ``jax.jit`` over at most
    ``UNROLLED_MAX_KEYS`` (48) keys leaves those rows out of products written out key by
    key instead, and checks nothing). With more, the value rows are zeroed, and
    :class:`DotProductAttention` zeroes the key rows in its backward pass only (on JAX,
    with a mask of one row for every query such as key lengths (B,), in the forward pass,
    with the queries that may attend no key). Masked calls have custom gradients: reverse
    mode only (not ``jax.jvp`` or ``jax.jacfwd``).

    After an eager call, :attr:`attention_weights` holds that call's weights (..., n, m)
    before dropout (inside ``jax.jit`` or a ``tf.function`` they are that trace's symbols).

    Args:
        dropout: dropout probability on the weights (training calls only), in [0, 1).
        normalizer: ``"softmax"`` (the one normalizer here).
        **kwargs: ``keras.layers.Layer``'s (``name``, ``dtype``, ...).

    Raises:
        ValueError: a bad ``dropout`` or ``normalizer``.
    """

    same_feature_size = False

    def __init__(self, dropout: float = 0.0, *, normalizer: str = "softmax", **kwargs: Any):
        super().__init__(**kwargs)
        self.dropout_rate = check_dropout(dropout)
        self.normalizer = check_normalizer(normalizer)
        self.dropout = keras.layers.Dropout(self.dropout_rate, dtype=self.dtype_policy)
        self._last_weights: Any = None

    def build(self, queries_shape: Any, keys_shape: Any = None, values_shape: Any = None) -> None:
        """Make the weights for inputs of these shapes (a scorer without weights: none)."""

    def score(self, queries: Any, keys: Any) -> Any:
        """Scores (..., n, m) of queries (..., n, q) over keys (..., m, k)."""
        raise NotImplementedError

    def check_features(self, queries: Any, keys: Any) -> None:
        """Raise a ValueError naming queries or keys whose feature size is not the
        weights' (a no-op for layers without weights)."""

    def score_unchecked(
        self, queries: Any, keys: Any, masks: tuple[Any, ...], zero_unattended: Any, *, check: bool
    ) -> Any:
        """Scores (..., n, m) of keys whose rows no query attends may hold NaN or inf, which
        must reach no gradient; ``zero_unattended(keys, *masks)`` zeroes those rows. Here:
        the scores of the zeroed keys (:class:`DotProductAttention` checks instead, or with
        ``check=False`` zeroes them in its backward pass only)."""
        return self.score(queries, zero_unattended(keys, *masks))

    def pool(self, queries: Any, keys: Any, values: Any, allowed: Any, training: Any) -> Any:
        """``dropout(masked_softmax(score(queries, keys), allowed)) @ values`` on inputs
        whose key and value rows no query attends are finite and the value rows zero (as
        :class:`MultiHeadAttention`'s heads are), ``allowed`` a bool mask broadcastable to
        (..., n, m) or None; keeps the weights for :attr:`attention_weights`."""
        scores = self.score(queries, keys)
        if allowed is None:
            return self._apply(softmax_where(scores, None), values, training)
        return self._pool_filled(scores, values, allowed, training)

    def _pool_filled(self, scores: Any, values: Any, allowed: Any, training: Any) -> Any:
        """The pooling of values whose rows no query attends are zero, by the softmax of
        ``scores`` with :func:`~attnscore_keras.masking.fill_softmax`: a softmax with no
        select after it, which XLA's CPU backend fuses with the products around it,
        forward and backward (MultiHeadAttention's training step at the BERT shape on
        JAX: 1.09x -> 1.02x Keras's layer against the softmax with exact zero rows,
        softmax_where). Rows where nothing is allowed get uniform weights there, and
        exact zeros after it: the output (a select) and the kept weights."""
        rank = len(allowed.shape) - 2
        weights = fill_softmax(scores, allowed, zero_rows=False)
        out = self._apply(weights, values, training)
        # The kept weights get the exact zeros here (dead code in a compiled call that
        # does not read them). Where ``allowed`` is one row for every query, such a row's
        # keys are all unattended, its values zero, and its output already 0.
        self.__dict__["_last_weights"] = ops.where(allowed, weights, ops.zeros_like(weights))
        if allowed.shape[-2] != 1:
            attends = used_rows(allowed, rank, out, axis=-1)
            out = ops.where(attends, out, ops.zeros_like(out))
        return out

    def _dropout_acts(self, training: Any) -> bool:
        """Whether dropout may act on this call's weights: a rate above 0, in a call not
        marked ``training=False``."""
        return self.dropout_rate > 0 and training is not False

    def _apply(self, weights: Any, values: Any, training: Any, pool: Any = None) -> Any:
        """Keep ``weights`` for :attr:`attention_weights`, drop some out (training calls),
        and pool ``values`` with them (``pool(weights, values)``, a matmul by default)."""
        self.__dict__["_last_weights"] = weights
        if self.dropout_rate > 0:
            weights = self.dropout(weights, training=training)
        return ops.matmul(weights, values) if pool is None else pool(weights, values)

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
        """Attention pooling of ``values`` by the weights of ``queries`` over ``keys``.

        Args:
            queries: (..., n, q) floating (``...`` is (B,) or (B, H)). keys: (..., m, k).
                values: (..., m, v). One dtype; dot-product-like scorers need q == k.
            valid_lens: key lengths (B,), (B, n) or (..., n); integer, or floating of
                whole numbers; lengths above m mean all keys.
            query_valid_lens: query lengths (B,) or (...,): later queries attend nothing.
            attend_mask: bool broadcastable to (..., n, m), True = may attend.
            causal: query i attends keys j <= i only (top-left aligned).
            training: dropout is applied in training calls only.

        Returns:
            (..., n, v) in the inputs' dtype; zero rows for queries that may attend no key.

        Raises:
            TypeError: non-floating inputs or mixed dtypes; masks of the wrong dtype.
            ValueError: inconsistent shapes, feature sizes unlike the weights', masks of the
                wrong shape, negative or fractional lengths (eager calls).
        """
        queries, keys, values = check_attention_inputs(
            queries, keys, values, same_feature_size=self.same_feature_size
        )
        self.check_features(queries, keys)
        scores_shape = (*shape_of(queries)[:-1], shape_of(keys)[-2])
        dynamic = (*ops.shape(queries)[:-1], ops.shape(keys)[-2])
        given = {
            "valid_lens": valid_lens,
            "query_valid_lens": query_valid_lens,
            "attend_mask": attend_mask,
        }
        allowed = build_allowed(scores_shape, dynamic, causal=causal, **given)
        if allowed is None:  # nothing masked, nothing to keep from the products
            return self.pool(queries, keys, values, None, training)
        # The masks as tensors, passed on to the products' conditionals and gradients,
        # which rebuild ``allowed`` from them where they need it (the slow branch, the
        # backward pass): as an operand, ``allowed`` would be written out, one more XLA
        # op at a decoder step; rebuilt it fuses into its consumers.
        names = [name for name, mask in given.items() if mask is not None]
        masks = tuple(ops.convert_to_tensor(given[name]) for name in names)
        rank = len(scores_shape) - 2

        def allowed_of(*raw: Any, key: int | None = None) -> Any:
            kwargs = dict(zip(names, raw, strict=True))
            return build_allowed(scores_shape, dynamic, causal=causal, key=key, **kwargs)

        def zero_unattended(x: Any, *raw: Any) -> Any:
            return zero_unused(allowed_of(*raw), rank, x, axis=-2)

        if query_valid_lens is not None:  # queries that attend nothing: zero rows
            queries = zero_unused(allowed, rank, queries, axis=-1)
        n = scores_shape[-2]
        if n is not None and n <= CHECKED_MAX_QUERIES:
            return self._pool_checked(queries, keys, values, allowed, masks, allowed_of, training)
        return self._pool_zeroed(queries, keys, values, allowed, masks, zero_unattended, training)

    def _pool_zeroed(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        allowed: Any,
        masks: tuple[Any, ...],
        zero_unattended: Any,
        training: Any,
    ) -> Any:
        """The pooling of a call with many queries whose unattended key and value rows
        may hold NaN or inf: the values' unattended rows are zeroed (a select over them),
        and the keys' only in the backward pass (the scores' masking keeps them from the
        forward pass). A softmax with no select or conditional after it fuses with the
        products around it (XLA's CPU backend, forward and backward), which checks
        would split (1.1x Keras's layer forward, 2.7x for the training step at
        (96, 128, 64), the conditional's copy of the output and the split softmax).
        ``zero_unattended(x, *masks)`` zeroes a key or value tensor's unattended rows."""
        rank = len(shape_of(queries)) - 2
        scores = self.score_unchecked(queries, keys, masks, zero_unattended, check=False)
        values = zero_unused(allowed, rank, values, axis=-2)
        return self._pool_filled(scores, values, allowed, training)

    def _pool_checked(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        allowed: Any,
        masks: tuple[Any, ...],
        allowed_of: Any,
        training: Any,
    ) -> Any:
        """The pooling of a call with few queries (a decoder step) whose unattended key and
        value rows may hold NaN or inf, without copying them with zeros (a pass over all
        keys and values, as long as the attention itself: 2.6x Keras's layer at B*H=32,
        n=1, m=32 on the CPU): the product weights @ values is checked (its first row)
        and redone with zeroed rows only where it is not finite, and so is the queries'
        gradient. Exact zero weights where nothing is allowed (a select that fuses into the
        softmax) also zero the weights' gradient there, NaN from unattended values
        included. ``allowed_of(*masks)`` rebuilds ``allowed``."""
        rank = len(allowed.shape) - 2

        def zero_unattended(x: Any, *raw: Any) -> Any:
            return zero_unused(allowed_of(*raw), rank, x, axis=-2)

        def weights_of(s: Any, *raw: Any) -> Any:
            return fill_softmax(s, allowed_of(*raw), zero_rows=True)

        scores = self.score_unchecked(queries, keys, masks, zero_unattended, check=True)
        # The slow branch of the pool recomputes the weights from the scores, unless
        # dropout may act (random: it would not drop the same again), when the dropped
        # weights are the branch's operand.
        redo = None if self._dropout_acts(training) else (scores, weights_of)
        return self._apply(
            fill_softmax(scores, allowed, zero_rows=True),
            values,
            training,
            lambda w, v: checked_pool(
                w, v, masks, zero_unattended, redo=redo, zero_in_backward=False
            ),
        )

    @property
    def attention_weights(self) -> Any:
        """The last call's weights (..., n, m), before dropout; None before any call."""
        return self.__dict__.get("_last_weights")

    def compute_output_shape(
        self, queries_shape: Any, keys_shape: Any = None, values_shape: Any = None
    ) -> tuple[Any, ...]:
        """(..., n, v) for queries (..., n, q) and values (..., m, v)."""
        return (*tuple(queries_shape)[:-1], tuple(values_shape)[-1])

    def get_config(self) -> dict[str, Any]:
        """The constructor's arguments (and ``keras.layers.Layer``'s), for ``from_config``
        and ``model.save``."""
        config: dict[str, Any] = super().get_config()
        config.update(dropout=self.dropout_rate, normalizer=self.normalizer)
        return config


def _sizes_error(name: str, size: int, shape: tuple[int | None, ...]) -> ValueError:
    return ValueError(
        f"Expected `{name}` with last dimension {size} (the layer's {name[:-1]}_size), but got "
        f"shape {shape} instead."
    )


def _tanh(x: Any) -> Any:
    """tanh in ``x``'s dtype: Keras 3.15's JAX ``ops.tanh`` returns float32 for float64
    input, so float64 takes ``2 sigmoid(2x) - 1`` (within 2e-16 of tanh)."""
    if dtype_of(x) == "float64":
        return 2.0 * ops.sigmoid(2.0 * x) - 1.0
    return ops.tanh(x)


@keras.saving.register_keras_serializable(package=_PACKAGE)
class AdditiveAttention(Attention):
    """Additive attention, ``a(q, k) = w_vᵀ tanh(W_q q + W_k k [+ b])``.

    Bahdanau et al. 2015, eq. (A.1.2); D2L eq. "additive-attn". Weights: ``W_q`` (q, h),
    ``W_k`` (k, h), ``w_v`` (h, 1) (Keras's (in, out) layout: the transposes of the PyTorch
    module's ``nn.Linear`` weights), and with ``bias`` or ``normalize`` ``b`` (h,), with
    ``normalize`` the gain ``g`` ().

    Args:
        key_size: k; None takes it from the first call's keys.
        query_size: q; None takes it from the first call's queries.
        num_hiddens: h, the hidden units of the scoring MLP (required).
        dropout, normalizer: as :class:`Attention`.
        bias: a learned bias ``b`` inside the tanh (Bahdanau's original form).
        normalize: weight-normalise ``w_v`` as ``g · w_v / ‖w_v‖`` (init g = 1/sqrt(h));
            implies ``bias``.

    Shapes: queries (..., n, q), keys (..., m, k), values (..., m, v) -> (..., n, v).

    Raises:
        ValueError: sizes that are not positive ints (``num_hiddens`` is required); in
            ``call``, as :meth:`Attention.call`.

    >>> import numpy as np
    >>> layer = AdditiveAttention(key_size=2, query_size=20, num_hiddens=8)
    >>> values = np.tile(np.arange(40.0, dtype="float32").reshape(1, 10, 4), (2, 1, 1))
    >>> out = layer(np.ones((2, 1, 20), "float32"), np.ones((2, 10, 2), "float32"), values,
    ...             np.array([2, 6]))
    >>> np.round(keras.ops.convert_to_numpy(out), 4)
    array([[[ 2.,  3.,  4.,  5.]],
    <BLANKLINE>
           [[10., 11., 12., 13.]]], dtype=float32)
    """

    def __init__(
        self,
        key_size: int | None = None,
        query_size: int | None = None,
        num_hiddens: int | None = None,
        dropout: float = 0.0,
        *,
        bias: bool = False,
        normalize: bool = False,
        normalizer: str = "softmax",
        **kwargs: Any,
    ):
        super().__init__(dropout, normalizer=normalizer, **kwargs)
        self.key_size = check_size(key_size, "key_size", optional=True)
        self.query_size = check_size(query_size, "query_size", optional=True)
        self.num_hiddens = check_size(num_hiddens, "num_hiddens")
        self.normalize = bool(normalize)
        self.bias = bool(bias) or self.normalize

    def build(self, queries_shape: Any, keys_shape: Any = None, values_shape: Any = None) -> None:
        """Make ``W_q``, ``W_k``, ``w_v`` (and ``b``, ``g``), sized by the constructor's
        arguments or, where those are None, by the shapes' last dimensions."""
        q = self.query_size or int(queries_shape[-1])
        k = self.key_size or int((keys_shape or queries_shape)[-1])
        self.query_size, self.key_size = q, k
        h = self.num_hiddens
        self.W_q = self.add_weight(name="W_q", shape=(q, h), initializer="glorot_uniform")
        self.W_k = self.add_weight(name="W_k", shape=(k, h), initializer="glorot_uniform")
        self.w_v = self.add_weight(name="w_v", shape=(h, 1), initializer="glorot_uniform")
        self.b = self.add_weight(name="b", shape=(h,), initializer="zeros") if self.bias else None
        self.g = (
            self.add_weight(
                name="g", shape=(), initializer=keras.initializers.Constant(1 / math.sqrt(h))
            )
            if self.normalize
            else None
        )

    def check_features(self, queries: Any, keys: Any) -> None:
        """A ValueError naming queries or keys whose last dimension is not the weights'."""
        for name, x, size in (("queries", queries, self.query_size), ("keys", keys, self.key_size)):
            if size is not None and x.shape[-1] is not None and x.shape[-1] != size:
                raise _sizes_error(name, size, shape_of(x))

    def score(self, queries: Any, keys: Any) -> Any:
        """``w_vᵀ tanh(W_q q [+ b] + W_k k)``: (..., n, m); builds (..., n, m, h) features."""
        qh = ops.matmul(queries, self.W_q)
        if self.b is not None:
            qh = qh + self.b
        kh = ops.matmul(keys, self.W_k)
        w = self.w_v
        if self.g is not None:
            w = self.g * w / ops.sqrt(ops.sum(ops.square(w)))
        features = _tanh(ops.expand_dims(qh, -2) + ops.expand_dims(kh, -3))  # (..., n, m, h)
        return ops.squeeze(ops.matmul(features, w), -1)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(
            key_size=self.key_size,
            query_size=self.query_size,
            num_hiddens=self.num_hiddens,
            bias=self.bias,
            normalize=self.normalize,
        )
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class DotProductAttention(Attention):
    """Scaled dot-product attention, ``softmax(Q Kᵀ · scale) V``.

    Vaswani et al. 2017, eq. (1); D2L eq. "softmax_QK_V"; with ``scale=1.0`` Luong et al.
    2015's "dot". No weights.

    Args:
        dropout, normalizer: as :class:`Attention`.
        scale: None for 1/sqrt(d); 1.0 for the unscaled dot product; any other float.

    Shapes: queries (..., n, d), keys (..., m, d), values (..., m, v) -> (..., n, v).

    Raises:
        TypeError: ``scale`` neither a float nor None.
        ValueError: in ``call``, queries and keys of different d; see :meth:`Attention.call`.

    >>> import numpy as np
    >>> values = np.tile(np.arange(40.0, dtype="float32").reshape(1, 10, 4), (2, 1, 1))
    >>> out = DotProductAttention(dropout=0.5)(
    ...     np.ones((2, 1, 2), "float32"), np.ones((2, 10, 2), "float32"), values,
    ...     np.array([2, 6]))
    >>> np.round(keras.ops.convert_to_numpy(out), 4)
    array([[[ 2.,  3.,  4.,  5.]],
    <BLANKLINE>
           [[10., 11., 12., 13.]]], dtype=float32)
    """

    same_feature_size = True

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        scale: float | None = None,
        normalizer: str = "softmax",
        **kwargs: Any,
    ):
        if scale is not None and (isinstance(scale, bool) or not isinstance(scale, (int, float))):
            raise TypeError(f"Expected `scale` to be a float or None, but got {scale!r} instead.")
        super().__init__(dropout, normalizer=normalizer, **kwargs)
        self.scale = None if scale is None else float(scale)
        self.built = True  # no weights to make

    def score(self, queries: Any, keys: Any) -> Any:
        """``scale · q·k`` (..., n, m); 16-bit inputs scale the products, not the queries."""
        return self._scaled(queries, lambda a: ops.matmul(a, ops.swapaxes(keys, -1, -2)))

    def score_unchecked(
        self, queries: Any, keys: Any, masks: tuple[Any, ...], zero_unattended: Any, *, check: bool
    ) -> Any:
        """:meth:`score` of keys whose unattended rows may hold NaN or inf: the masked
        softmax keeps them from the output, and the queries' gradient takes the keys with
        those rows zeroed (with ``check``, only where they are not finite; see
        :func:`~attnscore_keras.masking.checked_product`), so the keys are not copied in
        the forward pass."""
        return self._scaled(
            queries, lambda a: checked_product(a, keys, masks, zero_unattended, check=check)
        )

    def _one_op(self, queries: Any, training: Any) -> bool:
        """Whether this call takes the paths that never write the normalised weights out
        (:meth:`_pool_checked`, :meth:`_pool_zeroed`): float32 and float64 where dropout
        does not act (it acts on those weights)."""
        return not self._dropout_acts(training) and dtype_of(queries) not in SIXTEEN_BITS

    def _keep_weights(self, queries: Any, keys: Any, allowed: Any) -> None:
        """Keep the weights of a call those paths ran for :attr:`attention_weights`,
        computed again from the scores (an eager call's; dead code when compiled)."""
        weights = fill_softmax(self.score(queries, keys), allowed, zero_rows=True)
        self.__dict__["_last_weights"] = weights

    def _pool_checked(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        allowed: Any,
        masks: tuple[Any, ...],
        allowed_of: Any,
        training: Any,
    ) -> Any:
        """:meth:`Attention._pool_checked` as one op in float32 and float64 where dropout
        does not act (it acts on the normalised weights, which that op never writes out);
        else the shared path. The op: in a call compiled by ``jax.jit`` with one query
        and at most :data:`UNROLLED_MAX_KEYS` keys,
        :func:`~attnscore_keras.masking.unrolled_attention` (the products written out
        key by key, no check: 5 XLA ops forward at B=32, m=32 on the CPU, 9 for the
        training step, Keras's layer 7 and 14); else
        :func:`~attnscore_keras.masking.checked_attention`. The unrolled products lose
        to the library's as m or n grows (on the CPU, JAX: ahead of the checked op up to
        m = 48 at n = 1, 1.2x-1.3x its time at m = 64, 1.55x-1.65x at n = 4, m = 32), and
        eagerly they are some 4m ops each."""
        if not self._one_op(queries, training):
            return super()._pool_checked(
                queries, keys, values, allowed, masks, allowed_of, training
            )
        rank = len(allowed.shape) - 2
        m = keys.shape[-2]

        def attend(q: Any) -> Any:
            one = q.shape[-2] == 1
            if one and m is not None and m <= UNROLLED_MAX_KEYS and staged():
                return unrolled_attention(q, keys, values, masks, allowed_of)
            return checked_attention(q, keys, values, masks, allowed_of, rank)

        out = self._scaled(queries, attend)
        self._keep_weights(queries, keys, allowed)
        return out

    def _pool_zeroed(
        self,
        queries: Any,
        keys: Any,
        values: Any,
        allowed: Any,
        masks: tuple[Any, ...],
        zero_unattended: Any,
        training: Any,
    ) -> Any:
        """:meth:`Attention._pool_zeroed` in float32 and float64 where dropout does not
        act (it acts on the normalised weights, which this never writes out); else the
        shared path. The values' unattended rows are zeroed, and the softmax normalised
        after the product (:func:`~attnscore_keras.masking.normalised_pool`): dividing
        the weights first is one more pass over them on TensorFlow.

        The scores: on a backend in :data:`FILLED_SCORES_BACKENDS` (JAX), where the mask
        has one row for every query (key lengths per example),
        :func:`~attnscore_keras.masking.filled_scores` (the key rows zeroed, FILL
        added): XLA's CPU backend runs the scores, the softmax and both products as one
        op and never writes the scores out, which a select on them prevents. At
        (96, 128, 64) with key lengths, one process: 0.49x Keras's layer's time forward
        and 0.83x for the training step (the softmax normalised first, after a select
        on the scores: 1.08x and 1.05x). Elsewhere the scores' select, with the key rows
        zeroed in the backward pass only (:meth:`score_unchecked`): TensorFlow's XLA
        writes the scores out for the softmax's maximum either way (after a select or
        the addition), so zeroing the keys in the forward pass is one more pass there
        (1.05x-1.10x Keras's layer forward against 0.91x-1.01x, one process)."""
        if not self._one_op(queries, training):
            return super()._pool_zeroed(
                queries, keys, values, allowed, masks, zero_unattended, training
            )
        rank = len(shape_of(queries)) - 2
        values = zero_unused(allowed, rank, values, axis=-2)
        one_row = len(allowed.shape) < 2 or allowed.shape[-2] == 1
        if one_row and keras.backend.backend() in FILLED_SCORES_BACKENDS:
            scores = self._scaled(queries, lambda q: filled_scores(q, keys, allowed, rank))
            out = normalised_pool(scores, values)
        else:
            scores = self.score_unchecked(queries, keys, masks, zero_unattended, check=False)
            out = normalised_pool(scores, values, allowed)
        self._keep_weights(queries, keys, allowed)
        return out

    def _scaled(self, queries: Any, product: Any) -> Any:
        """``scale · product(queries)``, the scale on the queries (or, in 16 bits, on the
        products: one rounding of each score, not of q * s)."""
        d = queries.shape[-1]
        scale = self.scale if self.scale is not None else 1.0 / math.sqrt(d) if d else 1.0
        if scale == 1.0:
            return product(queries)
        factor = ops.convert_to_tensor(scale, dtype=queries.dtype)
        if dtype_of(queries) in SIXTEEN_BITS:
            return product(queries) * factor
        return product(queries * factor)

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(scale=self.scale)
        return config


@keras.saving.register_keras_serializable(package=_PACKAGE)
class MultiplicativeAttention(Attention):
    """General (multiplicative, bilinear) attention, ``a(q, k) = qᵀ W_a k``.

    Luong et al. 2015, eq. (8) "general". ``W_a`` is (q, k), as the PyTorch module's
    ``W_a.weight``; queries and keys may differ in size.

    Args:
        query_size: q (required).
        key_size: k; None takes it from the first call's keys.
        dropout, normalizer: as :class:`Attention`.

    Shapes: queries (..., n, q), keys (..., m, k), values (..., m, v) -> (..., n, v).

    Raises:
        ValueError: sizes that are not positive ints; in ``call``, feature sizes unlike
            ``W_a``'s.

    >>> import numpy as np
    >>> layer = MultiplicativeAttention(query_size=20, key_size=2)
    >>> tuple(layer(np.ones((2, 1, 20)), np.ones((2, 10, 2)), np.ones((2, 10, 4))).shape)
    (2, 1, 4)
    """

    def __init__(
        self,
        query_size: int,
        key_size: int | None = None,
        dropout: float = 0.0,
        *,
        normalizer: str = "softmax",
        **kwargs: Any,
    ):
        super().__init__(dropout, normalizer=normalizer, **kwargs)
        self.query_size = check_size(query_size, "query_size")
        self.key_size = check_size(key_size, "key_size", optional=True)

    def build(self, queries_shape: Any, keys_shape: Any = None, values_shape: Any = None) -> None:
        """Make ``W_a`` (q, k), k from the keys' shape where ``key_size`` is None."""
        self.key_size = self.key_size or int((keys_shape or queries_shape)[-1])
        self.W_a = self.add_weight(
            name="W_a", shape=(self.query_size, self.key_size), initializer="glorot_uniform"
        )

    def check_features(self, queries: Any, keys: Any) -> None:
        """A ValueError naming queries or keys whose last dimension is not the weights'."""
        for name, x, size in (("queries", queries, self.query_size), ("keys", keys, self.key_size)):
            if size is not None and x.shape[-1] is not None and x.shape[-1] != size:
                raise _sizes_error(name, size, shape_of(x))

    def score(self, queries: Any, keys: Any) -> Any:
        """``(q W_a) kᵀ`` (..., n, m)."""
        return ops.matmul(ops.matmul(queries, self.W_a), ops.swapaxes(keys, -1, -2))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(query_size=self.query_size, key_size=self.key_size)
        return config


def unit_rows(x: Any) -> Any:
    """Each row of ``x`` (..., d) over its norm; zero rows stay zero with a zero gradient
    (the squared norm is clamped to the dtype's smallest normal number before its root)."""
    tiny = {"float16": 6.104e-05, "bfloat16": 1.1755e-38, "float32": 1.1755e-38}
    squared = ops.sum(ops.square(x), axis=-1, keepdims=True)
    floor = ops.convert_to_tensor(tiny.get(dtype_of(x), 2.2251e-308), dtype=x.dtype)
    return x / ops.sqrt(ops.maximum(squared, floor))


@keras.saving.register_keras_serializable(package=_PACKAGE)
class CosineAttention(Attention):
    """Scaled cosine attention, ``a(q, k) = s · cos(q, k)``, s fixed or learned.

    Liu et al. 2022 (Swin Transformer V2), eq. (2), with s = 1/τ. The scale is kept as its
    logarithm ``log_scale`` (a weight, trainable with ``learn_scale``); zero vectors score 0.

    Args:
        dropout, normalizer: as :class:`Attention`.
        scale: s, the inverse temperature (default 10), positive.
        learn_scale: learn s.

    Shapes: queries (..., n, d), keys (..., m, d), values (..., m, v) -> (..., n, v).

    Raises:
        ValueError: ``scale`` not a positive float; in ``call``, as :meth:`Attention.call`.

    >>> import numpy as np
    >>> tuple(CosineAttention()(np.ones((2, 3, 4)), np.ones((2, 5, 4)), np.ones((2, 5, 6))).shape)
    (2, 3, 6)
    """

    same_feature_size = True

    def __init__(
        self,
        dropout: float = 0.0,
        *,
        scale: float = 10.0,
        learn_scale: bool = False,
        normalizer: str = "softmax",
        **kwargs: Any,
    ):
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
            raise ValueError(f"Expected `scale` to be a positive float, but got {scale!r} instead.")
        super().__init__(dropout, normalizer=normalizer, **kwargs)
        self.scale = float(scale)
        self.learn_scale = bool(learn_scale)

    def build(self, queries_shape: Any, keys_shape: Any = None, values_shape: Any = None) -> None:
        """Make ``log_scale`` (), trainable with ``learn_scale``."""
        self.log_scale = self.add_weight(
            name="log_scale",
            shape=(),
            initializer=keras.initializers.Constant(math.log(self.scale)),
            trainable=self.learn_scale,
        )

    def score(self, queries: Any, keys: Any) -> Any:
        """``s · unit(q) · unit(k)`` (..., n, m), s = exp(log_scale)."""
        wide = "float32" if dtype_of(queries) in SIXTEEN_BITS else queries.dtype
        s = ops.cast(ops.exp(ops.cast(self.log_scale, wide)), queries.dtype)
        return ops.matmul(unit_rows(queries) * s, ops.swapaxes(unit_rows(keys), -1, -2))

    def get_config(self) -> dict[str, Any]:
        config = super().get_config()
        config.update(scale=self.scale, learn_scale=self.learn_scale)
        return config


def make_scorer(
    name: str, size: int, dropout: float = 0.0, normalizer: str = "softmax", dtype: Any = None
) -> Any:
    """The layer of the scorer ``name`` with every size ``size`` (multi-head attention's
    per-head scorer, as attnscore's ``make_scorer``), in the dtype policy ``dtype`` (a
    multi-head layer's own: its scorer's weights in the heads' dtype)."""
    if name == "additive":
        return AdditiveAttention(size, size, size, dropout, normalizer=normalizer, dtype=dtype)
    if name in ("dot", "scaled_dot"):
        scale = 1.0 if name == "dot" else None
        return DotProductAttention(dropout, scale=scale, normalizer=normalizer, dtype=dtype)
    if name == "general":
        return MultiplicativeAttention(size, size, dropout, normalizer=normalizer, dtype=dtype)
    if name == "cosine":
        return CosineAttention(dropout, learn_scale=True, normalizer=normalizer, dtype=dtype)
    raise ValueError(
        f"Expected `scoring` to be one of {SCORER_NAMES} or an attention layer, but got "
        f"{name!r} instead."
    )


SCORER_NAMES = ("additive", "cosine", "dot", "general", "scaled_dot")
