"""How long a healthy job may take before a collective counts as hung: the process-group timeout and NCCL's
heartbeat, derived from the job's own planned step and save times instead of one fixed 10 minutes.

A rank that waits in a collective or p2p op for longer than the process group's timeout is aborted by PyTorch's
NCCL watchdog (``init_process_group(timeout=...)``; gloo raises in the op). Every legitimate wait has to fit under
it: the skew of the first step (checkpoint load, data index build on one rank while the others wait, first-step
compile and autotuning), a step (pipeline and DP waits), a checkpoint save (ranks wait in its barrier and
all-gathers). So, with ``step_s`` the planned step time and ``save_s`` the save time (measured in checkpoint.dir,
else the planner's estimate: launcher/core/signal_lead.py ``lead_for_render``)::

    first_step_s = max(FIRST_STEP_FLOOR_S, load_s + FIRST_STEP_STEPS x step_s)     load_s = save_s
    step_wait_s  = STEP_MARGIN x step_s
    save_wait_s  = slurm.signal_save_factor x save_s + step_s
    hang_s       = max(HANG_FLOOR_S, step_wait_s, save_wait_s)                     (timeouts.hang_s)
    collective_s = max(first_step_s, hang_s + HANG_LEAD_S)                         (timeouts.collective_s)
    heartbeat_s  = collective_s + HEARTBEAT_GRACE_S                               (timeouts.heartbeat_s)

``hang_s`` is the per-node watchdog's (launcher/rank/agent.py, launcher/rank/forensics.py): once a step has
completed, no collective progress on the node for that long is a hang; it dumps every rank's stacks, names the
rank that never entered the collective the others wait in, and stops the run, before the process group's
timeout would abort every rank with the same message.

FIRST_STEP_FLOOR_S is Megatron-LM's own ``--distributed-timeout-minutes`` default (10), so a small job keeps the
familiar timeout and a large one (slow saves, long steps) gets what it needs. NCCL's heartbeat monitor
(``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC``, torch's default 8 minutes) kills a rank whose watchdog thread stops
beating, e.g. while the watchdog itself is stuck dumping a timed-out collective: it must outlast the collective
timeout, or a hang dies before its Flight Recorder trace is written. Each value is overridden by its field;
render refuses an override below the planned step time (one step could never complete) and warns about one below
the first step's allowance. Torch-free: the login
node derives and renders them (env.sh ``LAUNCHER_COLLECTIVE_TIMEOUT_S``, meta.json ``timeouts``); the ranks read
the rendered value (launcher/rank/setup.py).
"""
from __future__ import annotations

import math
from typing import Optional

FIRST_STEP_FLOOR_S = 600
"""Megatron-LM's default process-group timeout (``--distributed-timeout-minutes 10``), the floor of the first step."""
FIRST_STEP_STEPS = 10
"""Steps' worth of time the first step may take beyond the load (compile, autotuning, warm-up of the allocator)."""
STEP_MARGIN = 5
"""A step may take this many planned steps before a wait inside it counts as hung (stragglers, a slow node)."""
HANG_FLOOR_S = 120
"""The hang watchdog waits at least this long without collective progress (a step of a second or two)."""
HANG_LEAD_S = 60
"""The derived collective timeout is at least the hang watchdog's + this: the watchdog dumps every rank's stacks and
names the hung rank before the process group aborts them all."""
HANG_ENV = "LAUNCHER_HANG_S"
"""env.sh exports the hang watchdog's threshold under this name (launcher/rank/agent.py reads it)."""
HEARTBEAT_GRACE_S = 120
"""How much longer than the collective timeout NCCL's heartbeat monitor waits (the timeout's own dump first)."""
DEFAULT_COLLECTIVE_S = FIRST_STEP_FLOOR_S
"""What a rank uses when its bundle rendered no timeout (a bundle of an older launcher, a test's bare config)."""
ENV = "LAUNCHER_COLLECTIVE_TIMEOUT_S"
"""env.sh exports the resolved collective timeout under this name; launcher/rank/setup.py reads it."""
HEARTBEAT_ENV = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"
"""PyTorch's NCCL heartbeat-monitor timeout (ProcessGroupNCCL), exported by env.sh on GPU clusters."""


FLIGHT_RECORDER_DIR = "flight-recorder"
"""Where in the bundle each rank's Flight Recorder dump lands (``rank-<global rank>``)."""
TRACE_BUFFER = 2000
"""Collectives each rank's Flight Recorder keeps (PyTorch's own suggestion for debugging hangs)."""


FR_BUFFER_ENV = "TORCH_FR_BUFFER_SIZE"
"""The Flight Recorder's size in torch >= 2.7 (torch/distributed/distributed_c10d.py reads it before its older name
``TORCH_NCCL_TRACE_BUFFER_SIZE``); it records gloo's collectives too, so every bundle sets it."""


def fr_env() -> list:
    """Every bundle's Flight Recorder: each rank keeps its last ``TRACE_BUFFER`` collectives (set before the process
    group exists, as env.sh is), which it writes into the hang evidence when the node's watchdog asks
    (launcher/rank/flight_recorder.py)."""
    return [(FR_BUFFER_ENV, str(TRACE_BUFFER))]


def gpu_env(timeouts: dict, bundle: str) -> list:
    """The NCCL watchdog's variables on a GPU cluster (cluster.env wins where it sets one): the heartbeat outlasts
    the collective timeout, and a collective that times out makes every rank dump its Flight Recorder (its last
    ``TRACE_BUFFER`` collectives, with sequence numbers and state) into the bundle, for the analysis torch ships
    (``python -m torch.distributed.flight_recorder.fr_trace``). The dump file's name is ``TORCH_FR_DUMP_TEMP_FILE``
    in recent PyTorch and ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` in older releases (both are set), as is the buffer's
    older name (``fr_env`` sets the newer one on every bundle)."""
    prefix = f"{bundle}/{FLIGHT_RECORDER_DIR}/rank-"
    return [(HEARTBEAT_ENV, str(timeouts["heartbeat_s"])), ("TORCH_NCCL_TRACE_BUFFER_SIZE", str(TRACE_BUFFER)),
            ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"), ("TORCH_FR_DUMP_TEMP_FILE", prefix),
            ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", prefix)]


def derive(job, *, step_s: Optional[float], save_s: Optional[float]) -> dict:
    """The timeouts to render, with what they rest on (meta.json ``timeouts``; ``action=plan`` prints them)."""
    step = step_s if step_s is not None and math.isfinite(step_s) and step_s > 0 else 0.0
    save = save_s if save_s is not None and math.isfinite(save_s) and save_s > 0 else 0.0
    first = max(FIRST_STEP_FLOOR_S, save + FIRST_STEP_STEPS * step)
    step_wait = STEP_MARGIN * step
    save_wait = job.slurm.signal_save_factor * save + step
    t = job.timeouts
    hang = int(t.hang_s) if t.hang_s is not None else math.ceil(max(HANG_FLOOR_S, step_wait, save_wait))
    derived = math.ceil(max(first, hang + HANG_LEAD_S))
    collective = int(t.collective_s) if t.collective_s is not None else derived
    heartbeat = int(t.heartbeat_s) if t.heartbeat_s is not None else collective + HEARTBEAT_GRACE_S
    return {"collective_s": collective, "heartbeat_s": heartbeat, "hang_s": hang,
            "collective_source": "timeouts.collective_s (explicit)" if t.collective_s is not None else "derived",
            "heartbeat_source": "timeouts.heartbeat_s (explicit)" if t.heartbeat_s is not None else "derived",
            "hang_source": "timeouts.hang_s (explicit)" if t.hang_s is not None else "derived",
            "first_step_s": math.ceil(first), "step_wait_s": math.ceil(step_wait), "save_wait_s": math.ceil(save_wait),
            "step_s": round(step, 3), "save_s": round(save, 3)}


def problems(job, timeouts: dict) -> list:
    """(field, value, rule, alternative, severity) for each explicit timeout that cannot work with the planned
    step (error), or that the first step may outlast (warning: the user may know the job starts faster)."""
    step, t, out = timeouts["step_s"], job.timeouts, []
    floor = math.ceil(max(STEP_MARGIN * step, FIRST_STEP_FLOOR_S))
    if t.collective_s is not None and step and t.collective_s <= step:
        return [("timeouts.collective_s", t.collective_s, f"is not longer than one planned step ({step:.0f} s): "
                 f"no step could complete", f"timeouts.collective_s={floor}", "error")]  # the others follow from it
    elif t.collective_s is not None and t.collective_s < timeouts["first_step_s"]:
        out.append(("timeouts.collective_s", t.collective_s, f"is shorter than the first step's allowance "
                    f"({timeouts['first_step_s']} s: checkpoint load, data index build, compile): the first step "
                    f"may time out", f"timeouts.collective_s={timeouts['first_step_s']}", "warning"))
    if timeouts["hang_s"] >= timeouts["collective_s"]:
        out.append(("timeouts.hang_s", timeouts["hang_s"], f"must be shorter than the collective timeout "
                    f"({timeouts['collective_s']} s): the watchdog names the hung rank before the process group "
                    f"aborts every rank", f"timeouts.hang_s={max(1, timeouts['collective_s'] - HANG_LEAD_S)}",
                    "error"))
    elif t.hang_s is not None and step and t.hang_s <= STEP_MARGIN * step:
        out.append(("timeouts.hang_s", t.hang_s, f"is not longer than {STEP_MARGIN} planned steps ({step:.0f} s "
                    f"each): a slow step would be reported as a hang", f"timeouts.hang_s="
                    f"{math.ceil(max(HANG_FLOOR_S, STEP_MARGIN * step + 1))}", "error"))
    if timeouts["heartbeat_s"] <= timeouts["collective_s"]:
        out.append(("timeouts.heartbeat_s", timeouts["heartbeat_s"], f"must outlast the collective timeout "
                    f"({timeouts['collective_s']} s), or a timed-out rank is killed before its trace is dumped",
                    f"timeouts.heartbeat_s={timeouts['collective_s'] + HEARTBEAT_GRACE_S}", "error"))
    return out
