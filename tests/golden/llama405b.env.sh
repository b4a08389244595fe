# Environment of run llama405b, from its cluster profile (cluster.env). Sourced by launch.sh on every node.
# CUDA_DEVICE_MAX_CONNECTIONS, unless cluster.env sets it, follows this job's settings as Megatron-LM requires
# (1 with TP/CP > 1 before Blackwell, 32 with the MoE all-to-all overlap, unset with Megatron-FSDP).
# Secrets are never written here: WANDB_API_KEY, HF_TOKEN pass through by
# name from the environment that submits the job (sbatch exports it; pyxis forwards it into the container).
export CUDA_DEVICE_MAX_CONNECTIONS=1
export NCCL_IB_TIMEOUT=22
export NCCL_NVLS_ENABLE=0
export NVTE_BWD_LAYERNORM_SM_MARGIN=16
export NVTE_FWD_LAYERNORM_SM_MARGIN=16
export PYTHONUNBUFFERED=1
export TORCH_NCCL_AVOID_RECORD_STREAMS=1
export LAUNCHER_BUNDLE=/lustre/runs/llama405b-golden
# How long one collective may wait before the process group aborts, and how long the node's watchdog waits
# without collective progress before it names the hung rank (from the planned step and save times; meta.json
# "timeouts" says from what; timeouts.collective_s and timeouts.hang_s override them).
export LAUNCHER_COLLECTIVE_TIMEOUT_S=600
export LAUNCHER_HANG_S=120
# PyTorch's Flight Recorder: each rank's last collectives, written into the hang evidence when the watchdog asks.
export TORCH_FR_BUFFER_SIZE=2000
# NCCL's watchdog: a timed-out collective dumps every rank's Flight Recorder trace into the bundle.
export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC=720
export TORCH_NCCL_TRACE_BUFFER_SIZE=2000
export TORCH_NCCL_DUMP_ON_TIMEOUT=1
export TORCH_FR_DUMP_TEMP_FILE=/lustre/runs/llama405b-golden/flight-recorder/rank-
export TORCH_NCCL_DEBUG_INFO_TEMP_FILE=/lustre/runs/llama405b-golden/flight-recorder/rank-
mkdir -p /lustre/runs/llama405b-golden/flight-recorder
