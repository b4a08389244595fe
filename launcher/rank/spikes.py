"""The loss-spike rule (train.spike_factor, issue 39): judge each step's loss before its update, roll a spike back to
the last checkpoint, replay the same batches bitwise, and skip the batch when the spike reproduces.

Written by hand: Megatron-Core's rerun state machine (megatron/core/rerun_state_machine.py) re-runs one step's
forward/backward in place to tell a transient fault from a reproducible result, but neither rolls back to a
checkpoint nor skips data; Megatron-LM's `--check-for-spiky-loss` compares with 10x the largest of the first 100
losses and stops. Here:

- the verdict: the step's loss (the world mean ``loop.reduce_report`` logs) above ``spike_factor`` x the median of
  the last ``spike_window`` judged losses (the rule waits for a full window);
- a first spike: no update (weights, optimizer, LR schedule as they were), the loop returns 'spike', the entry
  loads the newest checkpoint (all before the spike: the spiked step saves nothing), rebuilds the data iterators at
  its position and trains on: the same batches, the same RNG streams;
- the replay of that step: a spike again (the data did it) -> the step's batch is skipped (consumed, no update);
  not a spike (a transient fault: a bit flip, a bad GPU) -> training goes on from the replayed step, and the
  record names the rank (and host) whose own loss changed most between the two passes;
- every verdict is recorded in ``checkpoint.dir/spikes.json`` (the run's history) and the skips and the window in
  every later checkpoint's manifest, so a resume from any checkpoint skips the same batch at the same step and judges
  against the same window: the losses of a resumed run are the uninterrupted run's.

Rank-side code: every rank calls ``verdict`` at the same step (it holds one collective)."""
from __future__ import annotations

import json
import os
import socket
import statistics
from pathlib import Path
from typing import Callable, Optional

HISTORY = "spikes.json"
"""The run's spike history, beside its checkpoints."""


class SpikeGuard:
    """One run's spike rule, its window, its skips and the spike awaiting its replay."""

    def __init__(self, train, ckpt_dir: Path, kind: str, note: Callable[[str], None]):
        self.factor, self.size = train.spike_factor, train.spike_window
        self.lr_factor, self.lr_steps = train.spike_lr_factor, train.spike_lr_steps
        self.batch = train.global_batch_size
        self.ckpt_dir, self.kind, self.note = Path(ckpt_dir), kind, note
        self.window: list[float] = []
        self.skips: dict[int, int] = {}  # step -> samples consumed before it: the batch that step skips
        self.pending: Optional[dict] = None  # the first pass of a spike, until its replay judges it
        self.checkpointed = False  # a checkpoint to roll back to exists (saved or resumed from)
        self.events: list[dict] = _shared(lambda: _read(self.ckpt_dir / HISTORY).get("events", []))
        for event in self.events:
            if event.get("skipped"):
                self.skips[int(event["step"])] = int(event["consumed"])

    # ---- checkpoints ------------------------------------------------------------------------------------------
    def state(self) -> dict:
        """What a checkpoint keeps (its manifest's "spikes"): the window and the skips, so a resume judges and
        skips exactly as this run would have."""
        return {"window": list(self.window), "skipped": sorted([s, c] for s, c in self.skips.items())}

    def loaded(self, manifest: Optional[dict]) -> None:
        """A checkpoint was loaded (resume, or a rollback): its window; its skips join the history's."""
        self.checkpointed = manifest is not None
        state = (manifest or {}).get("spikes") or {}
        self.window = [float(x) for x in state.get("window", [])]
        for step, consumed in state.get("skipped", []):
            self.skips[int(step)] = int(consumed)

    def saved(self) -> None:
        self.checkpointed = True

    # ---- the verdict ------------------------------------------------------------------------------------------
    def verdict(self, step: int, consumed: int, local_loss: float) -> Optional[str]:
        """For the step being computed (1-based; ``consumed`` samples before it), after its forward/backward and
        before its update: 'skip' (no update: a known skip, a reproduced spike, or a spike with no checkpoint to
        replay from), 'rollback' (a first spike: no update, then the caller rolls back) or None (update)."""
        if self.skips.get(step) == consumed:
            return "skip"
        from launcher.rank.loop import reduce_report

        loss, _ = reduce_report(local_loss, None, self.kind)
        median = statistics.median(self.window) if len(self.window) >= self.size else None
        spiky = median is not None and loss > self.factor * median
        replay = self.pending if self.pending is not None and self.pending["step"] == step else None
        if replay is not None:
            self.pending = None
            if replay["consumed"] == consumed:
                return self._judged(replay, loss, spiky, local_loss, consumed)
            self.note(f"warning: the replay reached step {step} at sample {consumed}, not {replay['consumed']}: "
                      "judged afresh")
        if spiky:
            event = {"step": step, "consumed": consumed, "loss": loss, "median": median, "factor": self.factor,
                     "ranks": _rank_losses(local_loss, self.kind)}
            if not self.checkpointed:
                self._record(event, skipped=True, verdict="skipped without a replay: no checkpoint before it")
                self.skips[step] = consumed
                return "skip"
            self.pending = event
            self.note(f"warning: loss spike at step {step}: loss {loss:.4f} > {self.factor:g} x median "
                      f"{median:.4f} of the last {self.size} steps; update not applied, rolling back to the last "
                      "checkpoint to replay it")
            return "rollback"
        self.window = (self.window + [loss])[-self.size:]
        return None

    def _judged(self, first: dict, loss: float, spiky: bool, local_loss: float, consumed: int) -> Optional[str]:
        step = first["step"]
        event = dict(first, replayed_loss=loss)
        if spiky:
            self._record(event, skipped=True, verdict="reproduced: the batch is skipped")
            self.skips[step] = consumed
            self.note(f"warning: loss spike at step {step} reproduced on replay (loss {loss:.4f}, first "
                      f"{first['loss']:.4f}): its batch (samples {consumed}-{consumed + self.batch - 1}) is "
                      f"skipped" + (f"; the learning rate runs at {self.lr_factor:g}x for {self.lr_steps} steps"
                                    if self.lr_steps and self.lr_factor != 1 else ""))
            return "skip"
        culprit = _culprit(first["ranks"], _rank_losses(local_loss, self.kind))
        where = (f"rank {culprit['rank']} on {culprit['host']} (its loss {culprit['first']:.4f} first, "
                 f"{culprit['replayed']:.4f} on replay)" if culprit else "no rank's own loss changed")
        self._record(dict(event, suspect=culprit), skipped=False,
                     verdict=f"not reproduced: a transient fault is the likely cause ({where})")
        self.note(f"warning: loss spike at step {step} did not reproduce on replay (loss {loss:.4f}, first "
                  f"{first['loss']:.4f}): a transient hardware fault is the likely cause: {where}; training goes "
                  "on from the replayed step")
        self.window = (self.window + [loss])[-self.size:]
        return None

    def lr_scale(self, step: int) -> float:
        """The factor on the learning rate of ``step`` (1-based): spike_lr_factor for spike_lr_steps steps after
        each skipped spike, else 1."""
        if not self.lr_steps or self.lr_factor == 1:
            return 1.0
        return self.lr_factor if any(s < step <= s + self.lr_steps for s in self.skips) else 1.0

    def _record(self, event: dict, *, skipped: bool, verdict: str) -> None:
        event = dict(event, skipped=skipped, verdict=verdict)
        event.pop("ranks", None)
        self.events.append(event)
        if _rank() == 0:
            _write(self.ckpt_dir / HISTORY, {"events": self.events})


def _rank() -> int:
    import torch

    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _shared(read: Callable[[], list]) -> list:
    """Rank 0 reads (a shared checkpoint dir is one file system), every rank gets the same list."""
    import torch

    if not torch.distributed.is_initialized():
        return read()
    box = [read() if _rank() == 0 else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def _rank_losses(local_loss: float, kind: str) -> list:
    """(rank, host, this rank's own loss or None where it holds none): one all-gather, at a spike only."""
    import torch
    from megatron.core import parallel_state

    from launcher.core.pipeline.schedules import loss_rank

    holder = (parallel_state.get_pipeline_model_parallel_rank()
              == loss_rank(kind, parallel_state.get_pipeline_model_parallel_world_size())
              and parallel_state.get_tensor_model_parallel_rank() == 0)
    mine = [_rank(), socket.gethostname(), float(local_loss) if holder else None]
    every = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(every, mine)
    return every


def _culprit(first: list, replayed: list) -> Optional[dict]:
    """The loss-holding rank whose own loss changed most between the spiked pass and its replay."""
    pairs = [(a[0], a[1], a[2], b[2]) for a, b in zip(first, replayed) if a[2] is not None and b[2] is not None]
    if not pairs:
        return None
    rank, host, was, now = max(pairs, key=lambda p: abs(p[2] - p[3]))
    return None if was == now else {"rank": rank, "host": host, "first": was, "replayed": now}


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _write(path: Path, value: dict) -> None:
    tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(tmp, "w") as fh:
        fh.write(json.dumps(value, indent=1) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
