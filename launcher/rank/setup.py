"""Process group, Megatron parallel state and seeds."""
from __future__ import annotations

import datetime
import os

import torch

from launcher.core import Layout
from launcher.schema import ClusterConfig


def parallel_state_kwargs(layout: Layout) -> dict:
    """Arguments of ``parallel_state.initialize_model_parallel`` for this layout (None means "no VPP")."""
    return dict(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        virtual_pipeline_model_parallel_size=layout.vpp if layout.vpp > 1 else None,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep,
        expert_tensor_parallel_size=layout.etp)


def collective_timeout_s() -> int:
    """The process-group timeout env.sh rendered from the job's plan (launcher/core/timeouts.py), else Megatron-LM's
    default 10 minutes (a bundle rendered by an older launcher, a test's bare config)."""
    from launcher.core import timeouts

    raw = os.environ.get(timeouts.ENV, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else timeouts.DEFAULT_COLLECTIVE_S


def init_distributed(*, cluster: ClusterConfig, layout: Layout, seed: int, cuda_graph_impl: str = "none") -> None:
    """torch.distributed (nccl | gloo) from torchrun's env, then megatron.core parallel_state (and the RNG
    tracker: graph-safe under ``cuda_graph_impl``, see :func:`rng_tracker_kwargs`)."""
    from megatron.core import parallel_state, tensor_parallel

    if not torch.cuda.is_available():
        from models import cpu_compat

        cpu_compat.apply()
    else:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group(backend=cluster.backend,
                                             timeout=datetime.timedelta(seconds=collective_timeout_s()))
    world = torch.distributed.get_world_size()
    if world != layout.world:
        # torchrun started a different number of ranks than the job was planned for (nodes x gpus_per_node)
        raise ValueError(f"torchrun started {world} ranks but the job's layout is for {layout.world} "
                         f"(nodes x cluster.gpus_per_node); re-render the bundle for this allocation")
    if not layout.dp:
        raise ValueError(f"world size {world} is not a multiple of tensor x pipeline x context = "
                         f"{layout.model_parallel}")
    parallel_state.initialize_model_parallel(**parallel_state_kwargs(layout))
    from launcher.rank import forensics

    forensics.set_coords(pp=parallel_state.get_pipeline_model_parallel_rank(),  # for the hang watchdog's line
                         dp=parallel_state.get_data_parallel_rank(), tp=parallel_state.get_tensor_model_parallel_rank(),
                         cp=parallel_state.get_context_parallel_rank(), pp_size=layout.pp, dp_size=layout.dp,
                         dp_group=torch.distributed.get_process_group_ranks(parallel_state.get_data_parallel_group()))
    rank_seed = stage_seed(seed, parallel_state.get_pipeline_model_parallel_rank())
    torch.manual_seed(rank_seed)
    # Per-rank named RNG streams (TP dropout, and on a GPU every weight: with use_cpu_initialization=False
    # Megatron-Core/TE draw each weight inside get_cuda_rng_tracker().fork()); on CPU they are CPU generator
    # states (cpu_compat). Seeded from the stage's seed, so stage 1's layer j is not stage 0's layer j.
    tensor_parallel.model_parallel_cuda_manual_seed(
        rank_seed, **rng_tracker_kwargs(cuda_graph_impl, layout.transformer_engine))


def rng_tracker_kwargs(cuda_graph_impl: str, te: bool) -> dict:
    """The RNG tracker CUDA graphs need, as Megatron-LM sets it (initialize.py ``_set_random_seed(...,
    use_cudagraphable_rng=args.cuda_graph_impl != "none")``; arguments.py turns ``--te-rng-tracker`` on when
    "transformer_engine" is the transformer_impl or the cuda_graph_impl). Without graphs: Megatron's defaults.
    Megatron-Core's CudaGraphManager asserts "RNG tracker does not support cudagraphs!" otherwise."""
    if cuda_graph_impl == "none":
        return {}
    return {"te_rng_tracker": te or cuda_graph_impl == "transformer_engine", "use_cudagraphable_rng": True}


def stage_seed(seed: int, pp_rank: int) -> int:
    """The seed of pipeline stage ``pp_rank``: Megatron-LM's ``_set_random_seed`` (megatron/training/initialize.py)
    adds ``100 * pp_rank`` before seeding torch and the model-parallel RNG tracker, so stages draw different weights
    on the GPU init path. (It also adds ``10 * dp_rank`` under ``--data-parallel-random-init``, off by default: DP
    replicas must start equal.) The CPU init path reseeds every layer from its global number on top of this
    (models/builder.py), which keeps CPU initial weights layout-independent for the parity tests."""
    return seed + 100 * pp_rank


def close() -> None:
    from megatron.core import parallel_state

    if torch.distributed.is_initialized():
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
