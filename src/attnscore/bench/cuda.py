"""CUDA-only helpers of the bench: naming the GPU.

``attnscore bench --device cuda`` runs the same cells as the CPU run
(:mod:`attnscore.bench.matrix`, at its CUDA shapes); peak memory there is
``torch.cuda.max_memory_allocated`` during one step, reset per cell and implementation.
"""

from __future__ import annotations

import torch

from ._core import device_name


def describe(device: torch.device) -> str:
    """One line naming the GPU (or CPU), torch and CUDA versions."""
    cuda = torch.version.cuda
    return f"{device_name(device)}, torch {torch.__version__}" + (f", CUDA {cuda}" if cuda else "")
