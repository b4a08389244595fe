"""Process group, Megatron parallel state and seeds."""
from __future__ import annotations

import datetime
import os

import torch

from launcher.schema import ClusterConfig, ParallelConfig


def init_distributed(*, cluster: ClusterConfig, parallel: ParallelConfig, seed: int) -> None:
    """torch.distributed (nccl | gloo) from torchrun's env, then megatron.core parallel_state."""
    from megatron.core import parallel_state, tensor_parallel

    if not torch.cuda.is_available():
        from models import cpu_compat

        cpu_compat.apply()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=cluster.backend,
                                             timeout=datetime.timedelta(minutes=10))
    world = torch.distributed.get_world_size()
    model_parallel = parallel.tensor * parallel.pipeline * parallel.context
    if world % model_parallel:
        raise ValueError(f"world size {world} is not a multiple of tensor x pipeline x context = "
                         f"{model_parallel}")
    if parallel.data is not None and parallel.data != world // model_parallel:
        raise ValueError(f"parallel.data={parallel.data} but the world size implies {world // model_parallel}")
    vpp = parallel.virtual_pipeline if (parallel.virtual_pipeline or 1) > 1 else None
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallel.tensor, pipeline_model_parallel_size=parallel.pipeline,
        virtual_pipeline_model_parallel_size=vpp, context_parallel_size=parallel.context,
        expert_model_parallel_size=parallel.expert, expert_tensor_parallel_size=parallel.expert_tensor)
    torch.manual_seed(seed)
    # Per-rank named RNG streams (TP dropout etc.); on CPU they are CPU generator states (cpu_compat).
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def close() -> None:
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
