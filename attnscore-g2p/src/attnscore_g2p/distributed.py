"""Several training processes (DDP on gloo): the process group, spawning, the rendezvous port.

Under ``torchrun`` the processes come from its environment (:func:`distributed_env`);
otherwise :func:`spawn` starts them on 127.0.0.1 at a port found free (:func:`free_port`).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing


def distributed_env() -> tuple[int, int]:
    """``(rank, world_size)`` of this process from torchrun's ``RANK`` and ``WORLD_SIZE``
    (``(0, 1)`` without them)."""
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


@contextmanager
def process_group(rank: int, world_size: int, init_method: str | None = None) -> Iterator[None]:
    """Join the gloo process group of ``world_size`` processes as ``rank`` for the ``with``
    block (nothing to join for 1); ``init_method`` is the rendezvous URL (default
    ``env://``, as torchrun sets)."""
    distributed = world_size > 1
    if distributed and not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=init_method or "env://", rank=rank, world_size=world_size
        )
    try:
        yield
    finally:
        if distributed and dist.is_initialized():
            dist.destroy_process_group()


def broadcast_from_main(value: int, world_size: int) -> int:
    """Rank 0's ``value`` on every process (``value`` itself when ``world_size`` is 1)."""
    if world_size <= 1:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(t, src=0)
    return int(t.item())


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for the gloo rendezvous."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(worker: Callable[..., None], nprocs: int, *args: Any) -> None:
    """Run ``worker(rank, init_method, *args)`` in ``nprocs`` fresh processes, and wait;
    ``worker`` (a module-level function) and ``args`` are pickled into each process."""
    init_method = f"tcp://127.0.0.1:{free_port()}"
    torch.multiprocessing.spawn(  # type: ignore[attr-defined,no-untyped-call]
        _run_worker, args=(worker, init_method, args), nprocs=nprocs, join=True
    )


def _run_worker(
    rank: int, worker: Callable[..., None], init_method: str, args: tuple[Any, ...]
) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    worker(rank, init_method, *args)
