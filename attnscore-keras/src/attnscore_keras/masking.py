"""Masks and the masked softmax, in ``keras.ops`` (every backend, eager or compiled).

Shape legend: B batch, n queries, m keys; ``...`` are the leading batch dimensions of the
scores (B, or B and heads H). Every mask the layers take (key lengths per example or per
query, query lengths, a boolean "may attend" mask, causal masking) becomes one boolean
``allowed`` tensor broadcastable to (..., n, m), True where query i may attend key j.
"""

from __future__ import annotations

from typing import Any

from keras import ops

from ._checks import (
    SIXTEEN_BITS,
    as_tensor,
    check_floating,
    check_lengths,
    dtype_of,
    same,
    shape_of,
)

__all__ = ["masked_softmax", "sequence_mask"]


def _key_lengths(valid_lens: Any, batch: tuple[int | None, ...], n: int | None) -> Any:
    """Key lengths as int32 of shape broadcastable to (..., n, 1)."""
    lens = check_lengths(valid_lens, "valid_lens")
    shape = shape_of(lens)
    rank = len(batch)
    if len(shape) == 1 and same(shape[0], batch[0]):
        return ops.reshape(lens, (-1,) + (1,) * (rank + 1))
    if len(shape) == 2 and same(shape[0], batch[0]) and same(shape[1], n):
        return ops.reshape(lens, (-1,) + (1,) * (rank - 1) + (shape[1] or -1, 1))
    if len(shape) == rank + 1 and all(map(same, shape, (*batch, n))):
        return ops.expand_dims(lens, -1)
    expected = f"({batch[0]},) or ({batch[0]}, {n})"
    if rank > 1:
        expected += f" or {(*batch, n)}"
    raise ValueError(
        f"Expected `valid_lens` of shape {expected} for scores of shape {(*batch, n, '...')}, "
        f"but got shape {shape} instead."
    )


def build_allowed(
    scores_shape: tuple[int | None, ...],
    dynamic_shape: tuple[Any, ...],
    *,
    valid_lens: Any = None,
    query_valid_lens: Any = None,
    attend_mask: Any = None,
    causal: bool = False,
    key: int | None = None,
) -> Any:
    """The boolean tensor, broadcastable to ``scores_shape`` (..., n, m), that is True where
    query i may attend key j; None where nothing is masked. With ``key``, its column for
    that one key, broadcastable to (..., n, 1).

    Args:
        scores_shape: the scores' static shape (None for unknown dimensions).
        dynamic_shape: the scores' shape as ``keras.ops.shape`` gives it (tensors where a
            dimension is known only at run time).
        valid_lens: key lengths (B,), (B, n) or (..., n); lengths above m mean all keys.
        query_valid_lens: query lengths (B,) or (...,): queries at or beyond them attend
            nothing.
        attend_mask: bool, broadcastable to (..., n, m); True = may attend.
        causal: query i attends keys j <= i only (top-left aligned).
        key: None, or the index of the one key whose column is wanted (a Python int
            below m). Built for that key alone, not sliced out of the whole: XLA then
            fuses each column into its consumer (see :func:`key_sum`).

    Raises:
        TypeError: a mask of the wrong dtype, ``causal`` not a bool.
        ValueError: a mask of the wrong shape; negative or fractional lengths (eager calls).
    """
    batch, n = scores_shape[:-2], scores_shape[-2]
    n_dyn, m_dyn = dynamic_shape[-2], dynamic_shape[-1]
    allowed = None
    if key is None:
        cols = ops.arange(m_dyn, dtype="int32")
    else:
        cols = ops.convert_to_tensor([key], dtype="int32")

    def both(mask: Any) -> Any:
        return mask if allowed is None else ops.logical_and(allowed, mask)

    if valid_lens is not None:
        lens = _key_lengths(valid_lens, batch, n)
        allowed = both(ops.less(cols, lens))
    if not isinstance(causal, bool):
        raise TypeError(f"Expected `causal` to be a bool, but got {causal!r} instead.")
    if causal:
        rows = ops.expand_dims(ops.arange(n_dyn, dtype="int32"), -1)
        allowed = both(ops.greater_equal(rows, cols))
    if query_valid_lens is not None:
        q_lens = check_lengths(query_valid_lens, "query_valid_lens")
        shape = shape_of(q_lens)
        if len(shape) == 1 and same(shape[0], batch[0]):
            q_lens = ops.reshape(q_lens, (-1,) + (1,) * (len(batch) + 1))
        elif len(shape) == len(batch) and all(map(same, shape, batch)):
            q_lens = ops.reshape(q_lens, (*[-1 if d is None else d for d in shape], 1, 1))
        else:
            raise ValueError(
                f"Expected `query_valid_lens` of shape ({batch[0]},) or {batch}, but got shape "
                f"{shape} instead."
            )
        rows = ops.expand_dims(ops.arange(n_dyn, dtype="int32"), -1)
        allowed = both(ops.less(rows, q_lens))
    if attend_mask is not None:
        attend = as_tensor(attend_mask, "attend_mask")
        if dtype_of(attend) != "bool":
            raise TypeError(
                "Expected `attend_mask` to be a bool tensor (True = may attend; an additive "
                "float mask of 0 and -inf is `attend_mask=mask == 0`), but got dtype "
                f"{dtype_of(attend)} instead."
            )
        shape = shape_of(attend)
        padded = (1,) * (len(scores_shape) - len(shape)) + shape
        fits = len(shape) <= len(scores_shape) and all(
            a is None or b is None or a in (1, b) for a, b in zip(padded, scores_shape, strict=True)
        )
        if not fits:
            raise ValueError(
                f"Expected `attend_mask` broadcastable to {scores_shape}, but got shape {shape} "
                "instead."
            )
        if key is not None and shape[-1] != 1:
            attend = attend[..., key : key + 1]
        allowed = both(attend)
    return allowed


def softmax_where(scores: Any, allowed: Any) -> Any:
    """The masked softmax of ``scores`` (..., n, m) where ``allowed`` (bool, broadcastable,
    or None): exact zeros where not allowed, all-zero rows where nothing is; 16-bit scores
    are reduced in float32. Whatever ``scores`` holds where not allowed (NaN, inf) reaches
    neither the result nor the gradient."""
    dtype = dtype_of(scores)
    x = ops.cast(scores, "float32") if dtype in SIXTEEN_BITS else scores
    if allowed is None:
        weights = ops.softmax(x, axis=-1)
    else:
        x = ops.where(allowed, x, float("-inf"))
        top = ops.stop_gradient(ops.max(x, axis=-1, keepdims=True))
        top = ops.where(ops.isfinite(top), top, ops.zeros_like(top))
        e = ops.exp(x - top)  # exactly 0 where not allowed
        total = ops.sum(e, axis=-1, keepdims=True)
        weights = e / ops.where(total > 0, total, ops.ones_like(total))
    return ops.cast(weights, dtype) if dtype in SIXTEEN_BITS else weights


# float32's lowest finite value: the score of a masked entry in the layers' softmax. Finite,
# so a row with nothing allowed is finite (uniform) rather than NaN and needs no second
# reduction to find it; exp(FILL - max) is exactly 0 beside any allowed score above
# -1e38. Kept finite in float64 too (the softmax of 16-bit scores runs in float32).
FILL = -3.4028234663852886e38


def fill_softmax(scores: Any, allowed: Any, *, zero_rows: bool) -> Any:
    """The softmax over m of ``scores`` (..., n, m) with the entries ``allowed`` (bool,
    broadcastable) does not allow set to :data:`FILL`: exact zeros there in every row with
    an allowed entry; in a row with none, uniform weights, or exact zeros with
    ``zero_rows`` (one more select, which on XLA's CPU backend keeps the softmax out of the
    fused matmul that follows; its derivative, a select too, zeroes whatever the weights'
    gradient holds there, NaN included). NaN or inf where not allowed reaches neither the
    result nor the gradient. ``keras.ops.softmax``, not a softmax of our own: on JAX its
    custom derivative fuses with the products around it. 16-bit scores run in float32."""
    dtype = dtype_of(scores)
    x = ops.cast(scores, "float32") if dtype in SIXTEEN_BITS else scores
    weights = ops.softmax(ops.where(allowed, x, FILL), axis=-1)
    if zero_rows:
        weights = ops.where(allowed, weights, ops.zeros_like(weights))
    return ops.cast(weights, dtype) if dtype in SIXTEEN_BITS else weights


def used_rows(allowed: Any, batch_rank: int, x: Any, *, axis: int) -> Any:
    """Which rows of ``x`` (..., rows, features) some entry of ``allowed`` (broadcastable to
    (..., n, m), ``batch_rank`` leading dimensions) uses, as a bool (..., rows, 1): with
    ``axis=-2`` the keys (values) some query attends, with ``axis=-1`` the queries that
    attend some key. ``x``'s leading dimensions are all of the scores' or (B,) alone (a
    row is used if any head uses it)."""
    while len(allowed.shape) < batch_rank + 2:
        allowed = ops.expand_dims(allowed, 0)
    used = ops.any(allowed, axis=axis)
    extra = tuple(range(1, batch_rank - len(x.shape) + 3))
    if extra:
        used = ops.any(used, axis=extra)
    return ops.expand_dims(used, -1)


def zero_unused(allowed: Any, batch_rank: int, x: Any, *, axis: int) -> Any:
    """``x`` with zeros in the rows :func:`used_rows` says no entry of ``allowed`` uses
    (0 x NaN is NaN: what such a row holds would otherwise reach the products)."""
    return ops.where(used_rows(allowed, batch_rank, x, axis=axis), x, ops.zeros_like(x))


def project_used(x: Any, weight: Any, bias: Any, used: Any) -> Any:
    """``x @ weight [+ bias]`` (B, rows, o) of ``x`` (B, rows, i), ``weight`` (i, o),
    ``bias`` (o,) or None, where the rows of ``x`` that ``used`` (bool (B, rows, 1))
    marks False may hold NaN or inf and the caller discards theirs of the result (their
    gradient must be 0). The gradients of ``weight`` and ``bias`` take those rows as zeros
    (``xᵀ @ g`` would be NaN: 0 x NaN); ``x``'s is ``g @ weightᵀ``. Only the backward pass
    zeroes (a select over ``x``); ``used`` gets no gradient."""

    def project(xx: Any, w: Any, *rest: Any) -> Any:
        b, keep = (None, rest[0]) if len(rest) == 1 else rest
        y = ops.matmul(xx, w)
        if b is not None:
            y = y + b

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
            g = args[0] if upstream is None else upstream
            # Both weight gradients from one (B * rows, o) view of g: XLA otherwise lays
            # g out twice, once for each.
            g2 = ops.reshape(g, (-1, g.shape[-1]))
            zx = ops.reshape(ops.where(keep, xx, ops.zeros_like(xx)), (-1, xx.shape[-1]))
            dw = ops.matmul(ops.transpose(zx), g2)
            dx = ops.matmul(g, ops.transpose(w))
            if b is None:
                return dx, dw, None
            return dx, dw, ops.sum(g2, axis=0), None

        return y, grad

    args = (x, weight, used) if bias is None else (x, weight, bias, used)
    return ops.custom_gradient(project)(*args)


# XLA's CPU backend splits a reduction over a dimension longer than this into two more
# ops (a windowed reduction, then the rest); see _folded_finite.
_REDUCE_WINDOW = 32


def _folded_finite(*xs: Any) -> Any:
    """A scalar bool: every entry of each ``x`` (..., c) in ``xs`` is finite, as one XLA
    op on the CPU.

    The test is ``sum(x * 0) == 0``: 0 x NaN and 0 x inf are NaN, which the sum keeps,
    and 0 x a finite number is ±0 (no overflow). A float sum, not an AND of booleans:
    measured 2-5% faster for a whole forward call at a decoder step.

    One op: XLA's CPU backend rewrites a reduction over a dimension longer than 32 into a
    windowed reduction and a second one (three ops; at a decoder step each costs about a
    microsecond beside Keras's 12-17 µs call). So the zeros are first added in halves
    (slices, which fuse into the reduction) until no dimension is over 32, and those of
    all the tensors added together where their shapes agree: one reduction is left (a
    concatenation would be written out)."""
    folds: list[Any] = []
    for x in xs:
        z = x * ops.zeros((), dtype=x.dtype)
        c = z.shape[-1]
        if c is not None:
            z = ops.reshape(z, (-1, c))
            for axis in (1, 0):
                size = z.shape[axis]
                while size is not None and size > _REDUCE_WINDOW:
                    half = (size + 1) // 2  # odd sizes: the middle entry is in both halves
                    low = z[:, :half] if axis else z[:half]
                    high = z[:, size - half :] if axis else z[size - half :]
                    z, size = low + high, half
        for i, other in enumerate(folds):
            if tuple(other.shape) == tuple(z.shape):
                folds[i] = other + z
                break
        else:
            folds.append(z)
    total = ops.sum(folds[0])
    for more in folds[1:]:
        total = total + ops.sum(more)
    return ops.equal(total, ops.zeros((), dtype=total.dtype))


def first_row_finite(x: Any) -> Any:
    """A scalar bool: the first row ``x[..., 0, :]`` of a product ``a @ b`` (..., n, c) is
    all finite, which holds only if every entry of ``b`` is finite (where ``a`` is): a NaN
    or inf in ``b[..., j, c]`` makes column c of every row of the product NaN or inf, even
    where ``a[..., i, j]`` is 0 (0 x NaN and 0 x inf are NaN). One row, not the whole
    product: at n = 16 the check reads 1/16 of it. Not finite (overflow included) means
    only "take the slow path"; an empty product (n = 0) needs no check and passes."""
    return _folded_finite(x[..., 0, :])


def checked_product(
    a: Any, b: Any, masks: tuple[Any, ...], zero_unattended: Any, *, check: bool
) -> Any:
    """``a @ bᵀ`` (..., n, m) of ``a`` (..., n, d) and ``b`` (..., m, d) whose rows no
    query attends may hold NaN or inf; the scores' masking keeps them from the result, and
    this keeps them from the gradient of ``a``, ``g @ b`` (g is 0 in those columns, but
    0 x NaN is NaN), which takes ``zero_unattended(b, *masks)`` (those rows zeroed) instead
    of ``b``: with ``check``, only where the first row of ``a @ bᵀ`` says ``b`` is not all
    finite (see :func:`first_row_finite`; a conditional, no pass over ``b``), else always
    (a select over ``b`` that XLA's CPU backend fuses into nothing but feeds, as an input,
    to the fused softmax derivative and products, where a conditional would split them).
    The gradient of ``b`` is ``gᵀ @ a``; ``masks`` (the raw mask tensors) get none."""

    def product(x: Any, y: Any, *raw: Any) -> Any:
        scores = ops.matmul(x, ops.swapaxes(y, -1, -2))
        finite = first_row_finite(scores) if check else None

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
            g = args[0] if upstream is None else upstream
            if finite is None:
                dx = ops.matmul(g, zero_unattended(y, *raw))
            else:
                dx = ops.cond(
                    finite,
                    lambda: ops.matmul(g, y),
                    lambda: ops.matmul(g, zero_unattended(y, *raw)),
                )
            return (dx, ops.matmul(ops.swapaxes(g, -1, -2), x), *(None for _ in raw))

        return scores, grad

    return ops.custom_gradient(product)(a, b, *masks)


def checked_pool(
    weights: Any,
    values: Any,
    masks: tuple[Any, ...],
    zero_unattended: Any,
    *,
    redo: Any = None,
    zero_in_backward: bool,
) -> Any:
    """``weights @ values`` (..., n, v) where rows of ``values`` no query attends may hold
    NaN or inf, without a pass over ``values`` to zero them: the plain product, and, only
    where its first row is not all finite (:func:`first_row_finite`), the product with
    ``zero_unattended(values, *masks)`` (those rows zeroed; traced inside that branch
    alone). ``weights`` (..., n, m) must be exactly 0 where no query attends.

    ``redo``: None, or ``(tensor, function)``: the slow branch computes the weights as
    ``function(tensor, *masks)`` (the masked softmax of the scores) instead of taking
    ``weights`` as an operand of the conditional, which would make XLA write the weights
    out (at n = 128 it then cannot fuse the softmax into the product; at a decoder step it
    writes them twice, in two layouts). Without dropout the two are the same weights.

    The gradient of ``weights`` is ``g @ valuesᵀ``: NaN in the unattended columns, which
    the caller's masked softmax zeroes (a select whose derivative is a select) or, with
    ``zero_in_backward``, ``g @ zero_unattended(values)ᵀ`` (a select over ``values``
    feeding the fused softmax derivative rather than sitting inside it). The gradient of
    ``values`` is ``weightsᵀ @ g`` (0 in unattended rows). ``masks`` are arguments, not
    closures: JAX's custom gradients must not close over an enclosing ``jit``'s tracers."""
    extra = () if redo is None else (redo[0],)

    def pool(w: Any, v: Any, *rest: Any) -> Any:
        source, raw = (w, rest) if redo is None else (rest[0], rest[1:])
        out = ops.matmul(w, v)
        # One query (a decoder step): the conditional on (..., v), not (..., 1, v), which
        # XLA's CPU backend gives another layout and so a copy into it (one op fewer).
        one = w.shape[-2] == 1
        plain = out[..., 0, :] if one else out

        def slow() -> Any:
            again = source if redo is None else redo[1](source, *raw)
            fixed = ops.matmul(again, zero_unattended(v, *raw))
            return fixed[..., 0, :] if one else fixed

        out = ops.cond(first_row_finite(out), lambda: plain, slow)
        out = ops.expand_dims(out, -2) if one else out

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
            g = args[0] if upstream is None else upstream
            vv = zero_unattended(v, *raw) if zero_in_backward else v
            dw = ops.matmul(g, ops.swapaxes(vv, -1, -2))
            dv = ops.matmul(ops.swapaxes(w, -1, -2), g)
            return (dw, dv, *(None for _ in rest))

        return out, grad

    return ops.custom_gradient(pool)(weights, values, *extra, *masks)


def _unnormalised(s: Any, mask: Any) -> tuple[Any, Any]:
    """(e, r) of the softmax normalised after the product (:func:`checked_attention`,
    :func:`unrolled_attention`): ``e = exp(s - max)`` where ``mask`` allows, 0 elsewhere,
    and ``r`` one over each row's sum (1 for a row with no key: its e x r is 0)."""
    top = ops.stop_gradient(ops.max(ops.where(mask, s, FILL), axis=-1, keepdims=True))
    e = ops.exp(ops.where(mask, s, float("-inf")) - top)
    total = ops.sum(e, axis=-1, keepdims=True)
    return e, 1.0 / ops.where(total > 0, total, ops.ones_like(total))


def _scores_grad(gw: Any, w: Any, mask: Any) -> Any:
    """The softmax's derivative: the scores' gradient from ``gw`` = g @ valuesᵀ and the
    weights ``w``. ``gw`` is NaN in the columns of unattended NaN values; the selects drop
    it (w is 0 there, but 0 x NaN is NaN). Two selects, not one shared: each fuses into
    its consumer, where one would be written out."""
    inner = ops.sum(ops.where(mask, w * gw, 0.0), axis=-1, keepdims=True)
    return ops.where(mask, w * (gw - inner), 0.0)


def _folded_any(allowed: Any) -> Any:
    """``any(allowed, axis=-1, keepdims=True)`` as one XLA op on the CPU: halves OR-ed
    together (slices, which fuse into the reduction) until the last dimension is at most
    32 (see :data:`_REDUCE_WINDOW`; a longer one is split into three ops)."""
    size = allowed.shape[-1]
    while size is not None and size > _REDUCE_WINDOW:
        half = (size + 1) // 2  # odd sizes: the middle entry is in both halves
        allowed = ops.logical_or(allowed[..., :half], allowed[..., size - half :])
        size = half
    return ops.any(allowed, axis=-1, keepdims=True)


def filled_scores(queries: Any, keys: Any, allowed: Any, rank: int) -> Any:
    """``queries @ keysᵀ`` (..., n, m) with :data:`FILL` where ``allowed`` does not allow,
    for a mask with one row for every query (``allowed`` broadcastable to (..., 1, m):
    key lengths per example), whose key rows not allowed may hold NaN or inf. Queries
    (..., n, d), keys (..., m, d); ``rank`` leading dimensions.

    Built without a select on the scores: the key rows not allowed are zeroed (their
    scores are then exact zeros) and 0 or FILL added, (..., 1, m), to every row. An
    addition fuses where a select does not: on JAX, XLA's CPU backend then runs the
    scores, the softmax of :func:`normalised_pool` and both products as one op (a
    YNNPACK fusion, which takes no select) and never writes the scores out. The queries
    of rows with no key are zeroed too: a NaN or inf there would make its zero scores,
    and so FILL, NaN (0 x NaN is NaN), where a select on the scores keeps the row's
    output exactly zero. NaN or inf in those rows reaches neither the result nor the
    gradients (the selects' derivative is a select)."""
    zq = ops.where(_folded_any(allowed), queries, ops.zeros_like(queries))
    zk = zero_unused(allowed, rank, keys, axis=-2)
    fill = ops.cast(ops.where(allowed, 0.0, FILL), queries.dtype)
    return ops.matmul(zq, ops.swapaxes(zk, -1, -2)) + fill


def normalised_pool(scores: Any, values: Any, mask: Any = None) -> Any:
    """``softmax(scores) @ values`` (..., n, v), the softmax over m normalised after the
    product: ``(e @ values) * (1 / sum(e))`` with ``e = exp(scores - max)``, so that the
    weights are never written out (the product's multiplier is (..., n, 1)). Scores
    (..., n, m), values (..., m, v), float32 or float64.

    With ``mask`` (bool, broadcastable to the scores): ``e`` is exactly 0 where it does
    not allow (-inf before the exponential: NaN scores there reach nothing), and a row
    with nothing allowed is all zeros (:func:`_unnormalised`). Without: the scores where
    nothing is allowed must already be :data:`FILL` (:func:`filled_scores`), where ``e``
    is exactly 0 beside any allowed score above -1e38; a row with nothing allowed has
    ``e`` = 1 everywhere and is zero only where its values are zero rows. Either way the
    values' rows no query attends must be zero or finite (0 x NaN is NaN)."""
    if mask is None:
        top = ops.stop_gradient(ops.max(scores, axis=-1, keepdims=True))
        e = ops.exp(scores - top)
        r = 1.0 / ops.sum(e, axis=-1, keepdims=True)  # at least 1: the max's exp(0)
    else:
        e, r = _unnormalised(scores, mask)
    return ops.matmul(e, values) * r


def checked_attention(
    queries: Any, keys: Any, values: Any, masks: tuple[Any, ...], allowed_of: Any, rank: int
) -> Any:
    """``softmax(queries @ keysᵀ) @ values`` (..., n, v), the softmax over the keys each
    query may attend: ``allowed_of(*masks)`` (bool, broadcastable to (..., n, m), ``rank``
    leading dimensions) rebuilds where, from the raw mask tensors ``masks``. Queries
    (..., n, d), keys (..., m, d), values (..., m, v), float32 or float64, n small (a
    decoder step: the products are checked, not the inputs zeroed). A query that may
    attend no key gets exact zeros (and zero gradients). NaN or inf in the key and value
    rows no query attends reaches neither the output nor any gradient, and nothing copies
    those rows unless they hold it.

    One custom-gradient op, so that XLA runs few ops (each about a microsecond at a
    decoder step; Keras's layer runs 7 forward, 14 for a training step):

    - the softmax is normalised after the product, ``(e @ values) / sum(e)`` with
      ``e = exp(score - max)`` exactly 0 where not allowed (-inf before the exponential):
      the division fuses into the op that writes the output, where dividing the weights
      first writes them out once more;
    - one check, one reduction over the first rows of the scores and of ``e @ values``
      (:func:`first_row_finite`): NaN or inf in an unattended key makes its score, and in
      an unattended value its column of the product, not finite. Where the check fails the
      product is redone with those value rows zeroed, and the backward pass's product
      ``dS @ keys`` with those key rows zeroed (conditionals: no pass over the inputs
      otherwise);
    - the backward pass is written out (the softmax's derivative with a select that drops
      ``g @ valuesᵀ``'s NaN in unattended columns before the row sum), so it runs the ops
      Keras's layer runs, with the one conditional for the queries' gradient.

    With one query (n = 1) the softmax runs on (..., m), not (..., 1, m): XLA's CPU
    backend gives the latter another layout than the product's operand, and so a copy.

    Masks get no gradient. Reverse mode only (not ``jax.jvp``)."""

    def attend(q: Any, k: Any, v: Any, *raw: Any) -> Any:
        allowed = allowed_of(*raw)
        one = q.shape[-2] == 1

        def rows(x: Any) -> Any:  # (..., 1, c) -> (..., c) with one query; see above
            return x[..., 0, :] if one and len(x.shape) >= 2 else x

        def matrix(x: Any) -> Any:  # back to (..., 1, c) for the products
            return ops.expand_dims(x, -2) if one else x

        def zeroed(x: Any) -> Any:
            return zero_unused(allowed_of(*raw), rank, x, axis=-2)

        scores = ops.matmul(q, ops.swapaxes(k, -1, -2))
        s, mask = rows(scores), rows(allowed)
        e, r = _unnormalised(s, mask)
        num = ops.matmul(matrix(e), v)
        ok = _folded_finite(scores[..., 0, :], num[..., 0, :])
        # The conditional's operand sliced outside it (inside, XLA copies it into another
        # layout).
        plain = rows(num)
        kept = ops.cond(ok, lambda: plain, lambda: rows(ops.matmul(matrix(e), zeroed(v))))
        out = matrix(kept * r)

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
            g = args[0] if upstream is None else upstream
            w = e * r
            ds = _scores_grad(rows(ops.matmul(g, ops.swapaxes(v, -1, -2))), w, mask)
            # ds goes into the conditional as it is, (..., m) with one query, and becomes
            # a matrix inside: made outside, XLA gives it a layout it copies out of twice.
            dq = ops.cond(
                ok,
                lambda: rows(ops.matmul(matrix(ds), k)),
                lambda: rows(ops.matmul(matrix(ds), zeroed(k))),
            )
            dk = ops.matmul(ops.swapaxes(matrix(ds), -1, -2), q)
            dv = ops.matmul(ops.swapaxes(matrix(w), -1, -2), g)
            return (matrix(dq), dk, dv, *(None for _ in raw))

        return out, grad

    return ops.custom_gradient(attend)(queries, keys, values, *masks)


def _pairwise(terms: list[Any]) -> Any:
    """The sum of ``terms`` (tensors of one shape) added in pairs, a balanced tree (its
    rounding error grows with log2(len(terms)), as a blocked product's does)."""
    while len(terms) > 1:
        pairs = [terms[i] + terms[i + 1] for i in range(0, len(terms) - 1, 2)]
        terms = pairs + terms[len(terms) - len(terms) % 2 :]
    return terms[0]


def key_sum(w: Any, x: Any, column: Any) -> Any:
    """``w @ x`` for one query without the rows of ``x`` its mask leaves out, whatever
    they hold: ``sum_j where(column(j), w[..., j] * x[..., j, :], 0)``, the sum over
    the keys written out term by term. ``w`` (..., m), ``x`` (..., m, c), ``column(j)``
    the mask of key j, bool broadcastable to (..., 1). Returns (..., c).

    A product can not leave rows out: 0 x NaN is NaN. Written out, the select lands
    inside the sum, and XLA fuses every term, the selects and the pairwise sum into the
    one loop that writes the result: no pass over ``x``, no check, no conditional. For
    one query and few keys only (see :data:`~attnscore_keras.layers.UNROLLED_MAX_KEYS`):
    that loop is slower than the library's product as m or n grows, and its size grows
    with m. Compiled calls only: run op by op it is some 4m ops."""
    terms = []
    for j in range(x.shape[-2]):
        term = w[..., j : j + 1] * x[..., j, :]
        terms.append(ops.where(column(j), term, ops.zeros_like(term)))
    return _pairwise(terms)


def unrolled_attention(
    queries: Any, keys: Any, values: Any, masks: tuple[Any, ...], allowed_of: Any
) -> Any:
    """:func:`checked_attention` for one query (n = 1) without its check: the products
    with the values (forward) and with the keys (the queries' gradient) are
    :func:`key_sum`, which leaves out the key and value rows the query does not attend
    by construction, so XLA runs no conditional (and no reduction to check).

    Queries (..., 1, d), keys (..., m, d), values (..., m, v), float32 or float64;
    ``allowed_of(*masks)`` rebuilds where the query may attend from the raw mask tensors
    ``masks`` (bool, broadcastable to (..., 1, m)), and ``allowed_of(*masks, key=j)``
    key j's column of it. A query that may attend no key gets exact zeros (and zero
    gradients); NaN or inf in unattended rows reaches no output and no gradient. As in
    :func:`checked_attention` the softmax runs on (..., m), normalised after the
    product, and the backward pass is written out. Masks get no gradient. Reverse mode
    only."""

    def attend(q: Any, k: Any, v: Any, *raw: Any) -> Any:
        def rows(x: Any) -> Any:  # (..., 1, c) -> (..., c), as in checked_attention
            return x[..., 0, :] if len(x.shape) >= 2 else x

        def column(j: int) -> Any:
            # Each key's column built on its own: slices of the whole mask make XLA
            # write the mask out (one more op).
            return rows(allowed_of(*raw, key=j))

        s, mask = rows(ops.matmul(q, ops.swapaxes(k, -1, -2))), rows(allowed_of(*raw))
        e, r = _unnormalised(s, mask)
        out = ops.expand_dims(key_sum(e, v, column) * r, -2)

        def grad(*args: Any, upstream: Any = None) -> tuple[Any, ...]:
            g = args[0] if upstream is None else upstream
            w = e * r
            ds = _scores_grad(rows(ops.matmul(g, ops.swapaxes(v, -1, -2))), w, mask)
            dq = ops.expand_dims(key_sum(ds, k, column), -2)
            dk = ops.matmul(ops.expand_dims(ds, -1), q)
            dv = ops.matmul(ops.expand_dims(w, -1), g)
            return (dq, dk, dv, *(None for _ in raw))

        return out, grad

    return ops.custom_gradient(attend)(queries, keys, values, *masks)


def masked_softmax(X: Any, valid_lens: Any = None) -> Any:
    """Softmax over the last axis of ``X``, ignoring positions beyond the valid lengths.

    For row ``X[b, i, :]`` with valid length L = ``valid_lens[b]`` (or
    ``valid_lens[b, i]``) the result is ``softmax(X[b, i, :L])`` followed by m - L exact
    zeros. Rows with L = 0 are all zeros with zero gradient (not the textbook's uniform
    weights from its -1e6 fill, and not NaN); whatever ``X`` holds at masked positions
    (NaN, inf) changes neither the result nor the gradient. Written in ``keras.ops``: it
    runs on every Keras backend, eagerly and under ``jax.jit`` or
    ``tf.function(jit_compile=True)``.

    Args:
        X: scores (B, n, m), or (B, ..., n, m); float16, bfloat16, float32 or float64
            (16-bit scores are reduced in float32, and returned in their own dtype).
        valid_lens: None (plain softmax), or lengths (B,) (one per example), (B, n) (one
            per query) or (B, ..., n); an integer tensor, or a floating one of whole
            numbers. Lengths above m mean all positions.

    Returns:
        Weights of ``X``'s shape and dtype; each row sums to 1 over its valid positions, or
        is all zeros.

    Raises:
        TypeError: ``X`` not a floating tensor; ``valid_lens`` not integer-valued.
        ValueError: ``X`` with fewer than 3 dimensions; ``valid_lens`` of the wrong shape;
            negative or fractional lengths (checked in eager calls).

    Source: D2L "Attention Scoring Functions", the masked softmax operation (its TensorFlow
    listing fills masked scores with -1e6; here they are left out exactly).

    >>> import keras
    >>> import numpy as np
    >>> X = np.array([[[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]]], dtype="float32")
    >>> np.round(keras.ops.convert_to_numpy(masked_softmax(X, np.array([[2, 0]]))), 4)
    array([[[0.2689, 0.7311, 0.    ],
            [0.    , 0.    , 0.    ]]], dtype=float32)
    """
    X = check_floating(X, "X")
    if valid_lens is None:
        return softmax_where(X, None)
    allowed = build_allowed(shape_of(X), tuple(ops.shape(X)), valid_lens=valid_lens)
    return softmax_where(X, allowed)


def sequence_mask(X: Any, valid_len: Any, value: float = 0.0) -> Any:
    """``X`` (rows, m) (or (..., m)) with the entries at or beyond each row's valid length
    replaced by ``value``.

    Args:
        X: a tensor (..., m) of any dtype.
        valid_len: lengths broadcastable to ``X.shape[:-1]``, usually (rows,).
        value: what the masked entries become.

    Returns:
        A new tensor of ``X``'s shape and dtype.

    Raises:
        TypeError, ValueError: bad lengths, as :func:`masked_softmax`.

    Source: D2L "Attention Scoring Functions" (``d2l.sequence_mask``).

    >>> import keras
    >>> import numpy as np
    >>> keras.ops.convert_to_numpy(sequence_mask(np.ones((2, 3), "float32"), np.array([1, 2])))
    array([[1., 0., 0.],
           [1., 1., 0.]], dtype=float32)
    """
    X = as_tensor(X, "X")
    lens = check_lengths(valid_len, "valid_len")
    keep = ops.less(ops.arange(ops.shape(X)[-1], dtype="int32"), ops.expand_dims(lens, -1))
    return ops.where(keep, X, ops.cast(ops.convert_to_tensor(value), X.dtype))
