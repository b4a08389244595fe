"""Which checkpoint format a job's ranks write (torch-free: validation, render and the rank wing read it)."""
from __future__ import annotations

from launcher.schema import JobConfig

FSDP_FORMAT = "fsdp_dtensor"


def checkpoint_format(job: JobConfig) -> str:
    """``fsdp_dtensor`` under parallel.megatron_fsdp, else checkpoint.format. Megatron-FSDP writes no other format:
    its distributed optimizer refuses every other sharding type (megatron/core/optimizer/distrib_optimizer.py
    ``sharded_state_dict``: "sharding_type ... is not supported with Megatron FSDP") and Megatron-LM asserts
    "Megatron-FSDP requires the `fsdp_dtensor` checkpointing format" (megatron/training/arguments.py); so the
    default ``checkpoint.format=torch_dist`` means fsdp_dtensor for an FSDP job rather than a refusal."""
    return FSDP_FORMAT if job.parallel.megatron_fsdp else job.checkpoint.format
