"""``torch.export`` programs and ONNX files of models that hold attnscore's modules.

The standard routes work on any model that holds attnscore modules, with no wrapper:
``torch.export.export(model, args, dynamic_shapes=...)`` and ``torch.onnx.export(model,
args, dynamic_shapes=..., dynamo=True)``. While ``torch.export`` traces, attnscore's kernels
package runs every op as its plain PyTorch formulation (:func:`attnscore.kernels._dispatch.
exporting`), so the program holds plain PyTorch (or ONNX) operators only and runs without
attnscore or its C kernels, at every size its dynamic dimensions allow. This module adds two
conveniences over those routes, :func:`export_program` and :func:`export_onnx` (the
``[onnx]`` extra, imported only there), for a model called as ``model(queries, keys,
values[, valid_lens])``.

Shape legend: B batch, n queries, m keys, q / k / v feature sizes, E the output size of
:class:`~attnscore.MultiHeadAttention`. B, n and m are dynamic; feature sizes are fixed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from ..modules import Attention

if TYPE_CHECKING:
    from torch.export import ExportedProgram
    from torch.onnx import ONNXProgram

__all__ = [
    "INPUT_NAMES",
    "OUTPUT_NAMES",
    "dynamic_shapes",
    "export_onnx",
    "export_program",
]

#: The exported inputs' names, in order (``valid_lens`` only where the example has it).
INPUT_NAMES = ("queries", "keys", "values", "valid_lens")
#: The exported outputs' names.
OUTPUT_NAMES = ("output",)

_SHAPES = ("(B, n, q)", "(B, m, k)", "(B, m, v)")


def _check_module(module: object) -> nn.Module:
    if not isinstance(module, nn.Module):
        raise TypeError(
            "Expected `module` to be an nn.Module (an attnscore attention module, or a model "
            f"that holds them), but got {type(module).__name__} instead."
        )
    return module


def _check_inputs(example_inputs: object, dynamic: object) -> tuple[Tensor, ...]:
    if not isinstance(dynamic, bool):
        raise TypeError(f"Expected `dynamic` to be a bool, but got {dynamic!r} instead.")
    items = example_inputs if isinstance(example_inputs, (tuple, list)) else None
    if items is None or len(items) not in (3, 4) or not all(isinstance(t, Tensor) for t in items):
        got = type(example_inputs).__name__
        if items is not None:
            got = f"a {got} of " + ", ".join(type(t).__name__ for t in items)
        raise TypeError(
            "Expected `example_inputs` to be a tuple of tensors (queries, keys, values) or "
            f"(queries, keys, values, valid_lens), but got {got} instead."
        )
    inputs = tuple(t for t in items if isinstance(t, Tensor))
    for name, t, shape in zip(INPUT_NAMES, inputs, _SHAPES, strict=False):
        if t.ndim != 3:
            raise ValueError(
                f"Expected `{name}` of shape {shape} in `example_inputs`, but got shape "
                f"{tuple(t.shape)} instead."
            )
    if len(inputs) == 4:
        lengths = inputs[3]
        if lengths.ndim not in (1, 2) or lengths.is_floating_point() or lengths.dtype == torch.bool:
            raise ValueError(
                "Expected `valid_lens` in `example_inputs` to be an integer tensor of shape "
                f"(B,) or (B, n), but got shape {tuple(lengths.shape)} and dtype "
                f"{lengths.dtype} instead."
            )
    if dynamic:
        q, k = inputs[0], inputs[1]
        sizes = {"B": q.shape[0], "n": q.shape[1], "m": k.shape[1]}
        small = {name: size for name, size in sizes.items() if size < 2}
        if small:
            raise ValueError(
                "Expected example sizes B, n and m of at least 2 for dynamic=True "
                "(torch.export fixes sizes 0 and 1 seen while tracing), but got "
                + ", ".join(f"{name}={size}" for name, size in small.items())
                + " instead."
            )
    # One tensor passed twice (self-attention: x, x, x) would tie n to m while tracing.
    seen: set[int] = set()
    distinct = []
    for t in inputs:
        distinct.append(t.clone() if id(t) in seen else t)
        seen.add(id(t))
    return tuple(distinct)


def dynamic_shapes(example_inputs: Sequence[Tensor]) -> tuple[dict[int, Any], ...]:
    """The ``dynamic_shapes`` of :func:`torch.export.export` for (queries, keys, values
    [, valid_lens]): B, n and m dynamic (at least 1), feature sizes fixed.

    >>> [sorted(d) for d in dynamic_shapes([torch.ones(2, 3, 4)] * 3 + [torch.ones(2, 3)])]
    [[0, 1], [0, 1], [0, 1], [0, 1]]
    """
    from torch.export import Dim

    B, n, m = Dim("B", min=1), Dim("n", min=1), Dim("m", min=1)
    shapes: list[dict[int, Any]] = [{0: B, 1: n}, {0: B, 1: m}, {0: B, 1: m}]
    if len(example_inputs) == 4:
        shapes.append({0: B} if example_inputs[3].ndim == 1 else {0: B, 1: n})
    return tuple(shapes)


@contextlib.contextmanager
def _for_export(module: nn.Module) -> Iterator[None]:
    """Eval mode (dropout off) while exporting; the module's mode and its last call's
    weights (tracing would leave fake tensors there) are restored afterwards."""
    training = [(m, m.training) for m in module.modules()]
    kept = [(m, m.__dict__.get("_weights")) for m in module.modules() if isinstance(m, Attention)]
    module.eval()
    try:
        yield
    finally:
        for m, mode in training:
            m.training = mode
        for m, weights in kept:
            m.__dict__["_weights"] = weights


def export_program(
    module: nn.Module, example_inputs: Sequence[Tensor], *, dynamic: bool = True
) -> ExportedProgram:
    """``torch.export.export`` a model called as ``model(queries, keys, values[,
    valid_lens])``, with dynamic batch, query and key sizes, in eval mode.

    Over the standard route (see the module) this adds the dynamic sizes of the legend
    (:func:`dynamic_shapes`), checks of the example, and eval mode. The program computes
    what ``module.eval()(*example_inputs)`` computes, at any B, n and m (``dynamic=True``),
    in plain PyTorch operators, so running it needs torch only. Save it with
    ``torch.export.save(program, "attention.pt2")``; run
    ``torch.export.load(path).module()(q, k, v, valid_lens)``.

    Args:
        module: an :class:`~attnscore.Attention` module (``AdditiveAttention``,
            ``DotProductAttention``, :func:`~attnscore.make_scorer`'s, ...), a
            :class:`~attnscore.MultiHeadAttention`, or any ``nn.Module`` that holds them and
            takes the same inputs. Exported in eval mode (dropout off; its mode is restored
            afterwards); lazy sizes are fixed by one call on the examples.
        example_inputs: ``(queries (B, n, q), keys (B, m, k), values (B, m, v))`` of the
            module's floating dtype, optionally with ``valid_lens`` (B,) or (B, n)
            (integer): the exported program takes the same tuple, of the same dtypes,
            ranks and feature sizes.
        dynamic: B, n and m dynamic (each at least 1; the examples' must be at least 2);
            False fixes every size to the examples'.

    Returns:
        The ``ExportedProgram``: ``program.module()(queries, keys, values[, valid_lens])``
        gives the module's output, e.g. (B, n, v) ((B, n, E) for multi-head attention) in
        the inputs' dtype. Queries with no valid key (length 0) give zeros (multi-head:
        ``W_o``'s bias), never NaN; keys beyond the lengths change nothing.

    Raises:
        TypeError: ``module`` not an ``nn.Module``; ``example_inputs`` not a tuple of 3 or 4
            tensors; ``dynamic`` not a bool; inputs of the wrong dtype.
        ValueError: inputs that are not 3-D, ``valid_lens`` not integer (B,) or (B, n),
            example sizes below 2 with ``dynamic``; anything the module itself refuses
            (shapes, feature sizes, lengths), with its message.

    Source: ``torch.export`` (PyTorch 2.x), with ``torch.export.Dim`` for the sizes.

    >>> from attnscore import DotProductAttention
    >>> program = export_program(DotProductAttention(), (torch.randn(2, 3, 4),
    ...     torch.randn(2, 5, 4), torch.randn(2, 5, 6), torch.tensor([5, 2])))
    >>> output = program.module()(torch.randn(4, 7, 4), torch.randn(4, 9, 4),
    ...                           torch.randn(4, 9, 6), torch.tensor([9, 1, 0, 4]))
    >>> output.shape, bool((output[2] == 0).all())    # length 0: zeros
    (torch.Size([4, 7, 6]), True)
    """
    module = _check_module(module)
    inputs = _check_inputs(example_inputs, dynamic)
    with _for_export(module):
        with torch.no_grad():
            module(*inputs)  # the module's own checks; fixes lazy sizes
        shapes = dynamic_shapes(inputs) if dynamic else None
        return torch.export.export(module, inputs, dynamic_shapes=shapes)


def onnx_export(model: Any, args: tuple[Any, ...] = (), **options: Any) -> ONNXProgram:
    """``torch.onnx.export(model, args, dynamo=True, **options)`` as one in-memory model,
    without the exporter's warning on every export that torchvision's ops have no ONNX
    translation (errors still show)."""
    registration = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = registration.level
    registration.setLevel(logging.ERROR)
    try:
        program = torch.onnx.export(
            model, args, dynamo=True, external_data=False, verbose=False, **options
        )
    finally:
        registration.setLevel(level)
    assert program is not None
    return program


def _require_onnx() -> None:
    import importlib.util

    missing = [p for p in ("onnx", "onnxscript") if importlib.util.find_spec(p) is None]
    if missing:
        raise ModuleNotFoundError(
            f"Expected the packages onnx and onnxscript for ONNX export, but {', '.join(missing)} "
            "cannot be imported: install attnscore[onnx]."
        )


def export_onnx(
    module: nn.Module,
    example_inputs: Sequence[Tensor],
    path: str | os.PathLike[str] | None = None,
    *,
    dynamic: bool = True,
) -> ONNXProgram:
    """Export a model called as ``model(queries, keys, values[, valid_lens])`` to ONNX
    (``torch.onnx.export(..., dynamo=True)``).

    The model is :func:`export_program`'s program in ONNX operators: inputs named
    ``queries``, ``keys``, ``values`` (and ``valid_lens``, int64) with dynamic dimensions
    ``B``, ``n`` and ``m``; output ``output``. ONNX Runtime runs it without torch or
    attnscore::

        session = onnxruntime.InferenceSession("attention.onnx")
        (output,) = session.run(None, {"queries": q, "keys": k, "values": v, "valid_lens": L})

    Args:
        module, example_inputs, dynamic: as :func:`export_program`.
        path: where to save the model (one ``.onnx`` file, written through a temporary file
            in its folder and renamed into place); None saves nothing.

    Returns:
        The ``torch.onnx.ONNXProgram`` (``.model_proto``, ``.save(path)``, and
        ``program(*inputs)`` to run it with ONNX Runtime).

    Raises:
        ModuleNotFoundError: onnx or onnxscript missing (the ``[onnx]`` extra).
        ValueError: ``path`` not ending in ``.onnx``; as :func:`export_program`.
        TypeError: as :func:`export_program`.
        OSError: ``path`` cannot be written.

    Source: ``torch.onnx.export`` with the dynamo exporter (PyTorch 2.5+), opset 18+.

    >>> from attnscore import AdditiveAttention
    >>> example = (torch.randn(2, 3, 4), torch.randn(2, 5, 6), torch.randn(2, 5, 6),
    ...            torch.tensor([5, 2]))
    >>> onnx = export_onnx(AdditiveAttention(6, 4, 8), example, "a.onnx")  # doctest: +SKIP
    >>> [i.name for i in onnx.model.graph.inputs]  # doctest: +SKIP
    ['queries', 'keys', 'values', 'valid_lens']
    """
    if path is not None and Path(path).suffix.lower() != ".onnx":
        raise ValueError(f"Expected `path` ending in .onnx, but got {str(path)!r} instead.")
    _require_onnx()
    program = export_program(module, example_inputs, dynamic=dynamic)
    names = list(INPUT_NAMES[: len(program.example_inputs[0])])
    onnx_program = onnx_export(program, input_names=names, output_names=list(OUTPUT_NAMES))
    if dynamic:  # the legend's names, not the tracer's (s23, ...)
        inputs = onnx_program.model.graph.inputs
        q_shape, k_shape = inputs[0].shape, inputs[1].shape
        assert q_shape is not None and k_shape is not None
        legend: dict[Any, str] = {q_shape[0]: "B", q_shape[1]: "n", k_shape[1]: "m"}
        onnx_program.rename_axes(legend)
    if path is not None:
        write_bytes_atomic(Path(path), onnx_program.model_proto.SerializeToString())
    return onnx_program


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in its folder, renamed into place
    (no partial file is ever left at ``path``)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # as open(path, "wb") would make it
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
