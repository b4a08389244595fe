"""CUDA_DEVICE_MAX_CONNECTIONS for one job, derived from its settings the way Megatron-LM 0.19 states the rules.

The number of hardware work queues decides what can overlap: with 1, kernels start in issue order, which the
TP/SP communication overlap relies on (Megatron-Core ``tensor_parallel/layers.py``: "we rely on
CUDA_DEVICE_MAX_CONNECTIONS=1 to ensure that the ... communication is scheduled before the compute"); with more,
a communication stream can run beside compute, which Megatron-FSDP and the MoE all-to-all overlap need.

- Megatron-FSDP: not 1 (``megatron/training/arguments.py`` validate_args: "FSDP requires
  CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset"; docs/user-guide/features/megatron_fsdp.md: "unset
  CUDA_DEVICE_MAX_CONNECTIONS"): left unset.
- ``overlap_moe_expert_parallel_comm`` (parallel.moe_a2a_overlap): 32 (``megatron/core/transformer/moe/README.md``:
  "Requirements for EP A2A Overlap: ... CUDA_DEVICE_MAX_CONNECTIONS > 1"; Megatron-LM's skills/mcore-run-on-slurm:
  "overlap_moe_expert_parallel_comm uses 32"). With TP/CP > 1 before Blackwell Megatron-LM only warns that the two
  want different values ("1 or 32, which depends on which parallelization you want to prioritize"); the job asked
  for the overlap, so the overlap gets its queues (set cluster.env.CUDA_DEVICE_MAX_CONNECTIONS=1 to prefer TP).
- Tensor or context parallelism before Blackwell, otherwise: 1 (arguments.py asserts it; tp_comm_overlap needs TP
  and sequence parallelism, so it is covered by this rule).
- Anything else (TP = CP = 1, Blackwell and later, CPU): no requirement, left unset (arguments.py: "requirement
  no longer exists since the Blackwell architecture").

The GPU profiles say ``CUDA_DEVICE_MAX_CONNECTIONS: auto``; any other value in the job's ``cluster.env`` (profile,
recipe or command line: ``cluster.env.CUDA_DEVICE_MAX_CONNECTIONS=8``) is kept as written, and validation checks
the value the ranks will see against the same rules.
"""
from __future__ import annotations

from typing import Dict, Optional

from launcher.schema import JobConfig

VAR = "CUDA_DEVICE_MAX_CONNECTIONS"
PRE_BLACKWELL = ("H100", "H200", "GH200", "A100")
"""GPUs on which Megatron-LM ties tensor/context parallelism to CUDA_DEVICE_MAX_CONNECTIONS=1 (arguments.py:
"CUDA_DEVICE_MAX_CONNECTIONS requirement no longer exists since the Blackwell architecture")."""
A2A_OVERLAP_CONNECTIONS = "32"
AUTO = "auto"
"""cluster.env value meaning "derive it from the job" (the GPU profiles' value)."""
CPU_OFFLOAD_V1 = "NVTE_CPU_OFFLOAD_V1"
"""Megatron-LM arguments.py, with --fine-grained-activation-offloading: "For fine-grained activation offloading with
TE >= 2.10.0, NVTE_CPU_OFFLOAD_V1 should be set to 1 to avoid offloading weights." TE reads it when its CPU offload
module loads; TE < 2.10 has no other implementation and ignores it, so a job with offloading always sets it."""


def derived_for(*, gpu: str, megatron_fsdp: bool, moe_a2a_overlap: bool, tensor: int, context: int) -> Optional[str]:
    """The rules above on the settings they read (None: leave the variable unset)."""
    if gpu == "cpu" or megatron_fsdp:
        return None
    if moe_a2a_overlap:
        return A2A_OVERLAP_CONNECTIONS
    if (tensor > 1 or context > 1) and gpu in PRE_BLACKWELL:
        return "1"
    return None


def derived_max_connections(job: JobConfig) -> Optional[str]:
    """The value the job's settings call for (None: leave the variable unset)."""
    p = job.parallel
    return derived_for(gpu=job.cluster.gpu, megatron_fsdp=p.megatron_fsdp, moe_a2a_overlap=p.moe_a2a_overlap,
                       tensor=p.tensor, context=p.context)


def max_connections(job: JobConfig) -> Optional[str]:
    """The value the ranks will see: the job's cluster.env entry unless it is ``auto`` (or absent), else the
    derived one."""
    value = job.cluster.env.get(VAR)
    if value is None or str(value) == AUTO:
        return derived_max_connections(job)
    return str(value)


def job_env(job: JobConfig) -> Dict[str, str]:
    """cluster.env with CUDA_DEVICE_MAX_CONNECTIONS resolved (``auto`` -> derived, or dropped when the job needs
    none), NVTE_CPU_OFFLOAD_V1=1 with activation offloading (``CPU_OFFLOAD_V1``), and train.deterministic's
    NCCL/cuBLAS/TE settings (launcher/core/determinism.py): what env.sh exports and what a Megatron-LM launch of
    the job sets."""
    env = {str(k): str(v) for k, v in job.cluster.env.items() if str(k) != VAR}
    value = max_connections(job)
    if value is not None:
        env[VAR] = value
    if job.train.activation_offload_modules:  # unless the job set it (validation refuses anything but "1")
        env.setdefault(CPU_OFFLOAD_V1, "1")
    if job.train.deterministic:  # NCCL, cuBLAS and TE read these at first use: before any rank starts
        from launcher.core.determinism import env_for

        env = env_for(env)
    return env
