"""torchrun restarts (``--max-restarts``): a fresh namespace in the agent's store for each attempt.

With torchrun's c10d rendezvous the ranks are clients of the agent's TCPStore, and torch 2.x reuses that store
across restarts without a per-attempt prefix: the restarted ranks read the previous attempt's gloo/NCCL
addresses for Megatron's sub-groups (``new_group``) and fail with "Gloo connectFullMesh failed ... Connection
refused" (seen here after a kill -9 of one rank). Initialising the default process group on a PrefixStore
named after TORCHELASTIC_RESTART_COUNT gives every attempt its own keys.
"""
from __future__ import annotations

import datetime
import os

TIMEOUT = datetime.timedelta(minutes=10)


def init_process_group_for_restart(backend: str) -> bool:
    """On a torchrun restart (attempt > 0, agent store), init the default group under a per-attempt prefix;
    returns whether it did (otherwise the normal env:// initialisation applies)."""
    import torch.distributed as dist

    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or dist.is_initialized():
        return False
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    client = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=world,
                           is_master=False, timeout=TIMEOUT)
    store = dist.PrefixStore(f"/launcher/attempt_{attempt}", client)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    return True
