"""How a test that starts ranks itself sets up their process group, without a port race.

The rule (torchrun's agent store): the process that serves the rendezvous binds a port the kernel picks and hands
the bound port to the ranks, which connect as clients. Never find a free port, release it, and let a rank bind it
later: between the two, any socket on the machine (another test's ranks, gloo's connections, the load script's
runs) can take it, and rank 0 fails with EADDRINUSE (``benchmarks/suite_under_load.py`` at fe8e865, run 1).
A world of one needs no port at all (an in-memory store).
"""
from __future__ import annotations

from datetime import timedelta

TIMEOUT = timedelta(minutes=30)
"""Store operations' timeout: a hang detector for a rank that never joins, far beyond a loaded machine's start."""


def host(world: int):
    """A rendezvous TCPStore served by this process on a kernel-chosen port; keep the returned store referenced
    while the ranks run, pass them ``store.port``."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, world, True, TIMEOUT, wait_for_workers=False)


def join(port: int, rank: int, world: int, backend: str = "gloo", timeout: timedelta | None = None) -> None:
    """In a rank: the default process group, as a client of the store ``host`` serves on ``port``."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", int(port), world, False, TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout or TIMEOUT)


def init_single(backend: str = "gloo") -> None:
    """A world-1 default process group in this process (an in-memory store: no port)."""
    import torch.distributed as dist

    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
