"""The canonical attention mask (a leaf module: the masking layer builds it, the kernels and
normalizers read it).

Shapes as in the legend of :mod:`attnscore.masking`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch._C._functorch import is_functorch_wrapped_tensor

from ._checks import in_transform


def compact(t: Tensor) -> Tensor:
    """A view of ``t`` with size 1 wherever ``t`` is expanded (stride 0), as a mask's lengths
    arrive over heads and queries: the smallest tensor that broadcasts back to it."""
    strides = t.stride()
    sizes = [1 if stride == 0 else size for size, stride in zip(t.shape, strides, strict=True)]
    if sizes == list(t.shape):
        return t
    # one view op (slicing takes one per dim), where nothing traces or wraps ``t``
    if not (in_transform() or is_functorch_wrapped_tensor(t)):
        return t.as_strided(sizes, strides)
    return t[tuple(slice(0, size) for size in sizes)]


@dataclass(frozen=True)
class AttentionMask:
    """Which of m keys each of n queries may attend, in one checked form.

    ``lengths`` (int64, shape (..., n), values in [0, m]): query i may attend keys
    j < lengths[..., i]. ``attend`` (bool, broadcastable to (..., n, m)):
    True = may attend. Either may be None (no restriction); a key is attended when both
    allow it. Build it with :func:`attnscore.masking.build_mask`, which checks every input.

    ``lengths`` is everything that lengths express, folded together: key lengths, causal
    masking and query lengths. The parts are kept too, because PyTorch's own attention
    kernels take them separately and can skip work with them:

    - ``key_lengths``: the key lengths alone (``valid_lens``), shape (..., n), or None;
    - ``query_lengths``: query lengths broadcastable to the batch shape (...), or None
      (queries at or beyond them attend nothing);
    - ``causal``: query i also attends keys j <= i only (top-left alignment).

    A mask built by hand with ``lengths`` alone is valid: its lengths are then taken as
    key lengths per query.

    >>> mask = AttentionMask(n=2, m=3, lengths=torch.tensor([[1, 0]]))
    >>> mask.dense()
    tensor([[[ True, False, False],
             [False, False, False]]])
    >>> mask.padded_keys()   # keys no query may attend
    tensor([[False,  True,  True]])
    """

    n: int
    m: int
    lengths: Tensor | None = None
    attend: Tensor | None = None
    key_lengths: Tensor | None = None
    query_lengths: Tensor | None = None
    causal: bool = False

    @property
    def unmasked(self) -> bool:
        """True when every query may attend every key."""
        return self.lengths is None and self.attend is None

    def dense(self) -> Tensor | None:
        """The mask as bool, broadcastable to (..., n, m); True = may attend. None if none."""
        dense = self.attend
        if self.lengths is not None:
            positions = torch.arange(self.m, device=self.lengths.device)
            by_length = positions < self.lengths.unsqueeze(-1)
            dense = by_length if dense is None else dense & by_length
        return dense

    def padded_keys(self) -> Tensor | None:
        """Bool (..., m): True for keys that no query may attend (padding). None if none."""
        if self.attend is None:
            if self.lengths is None:
                return None
            if self.n == 0:  # no query attends anything: every key is padding
                longest = self.lengths.new_zeros((*self.lengths.shape[:-1], 1))
            elif self.lengths.stride(-1) == 0:  # one length for all queries (expanded)
                longest = self.lengths[..., :1]
            else:
                longest = self.lengths.amax(dim=-1, keepdim=True)
            return torch.arange(self.m, device=longest.device) >= longest
        dense = self.dense()
        assert dense is not None
        # A mask given as (m,) applies to every query.
        return ~dense if dense.ndim < 2 else ~dense.any(dim=-2)

    def idle_queries(self) -> Tensor | None:
        """Bool (..., n): True for queries that may attend no key. None if there is no mask."""
        if self.attend is None:
            return None if self.lengths is None else self.lengths == 0
        dense = self.dense()
        assert dense is not None
        return ~dense.any(dim=-1)
