"""What operators reach for, on the ranks: profiling a step range, a CUDA memory snapshot on out-of-memory, and
deterministic mode (``profile.*``, ``train.deterministic``). Everything is written under ``BUNDLE/profile/``.

- ``profile.kind=torch`` (Megatron-LM's --use-pytorch-profiler): ``torch.profiler.profile`` over steps
  ``step_start .. step_end - 1`` on the ranks in ``profile.ranks``, CPU activity and CUDA where there is a GPU,
  one Chrome trace per rank through ``tensorboard_trace_handler`` (``profile/torch/rank<N>.<time>.pt.trace.json``:
  TensorBoard's profiler plugin, Perfetto and chrome://tracing open it); each step is a ``ProfilerStep#N`` span.
- ``profile.kind=nsys`` (Megatron-LM's --profile): the bundle's ``rank.sh`` runs the profiled ranks under
  ``nsys profile --capture-range=cudaProfilerApi``; here the ranks open the capture range at ``step_start``
  (``cudaProfilerStart`` and ``emit_nvtx``: one NVTX range per autograd op) and close it before ``step_end``.
- ``profile.memory_snapshot`` (Megatron-LM's --record-memory-history): ``torch.cuda.memory._record_memory_history``
  from the rank's start; a ``torch.cuda.OutOfMemoryError`` dumps the history to ``profile/memory-rank<N>.pickle``
  (https://pytorch.org/memory_viz draws it) before the error ends the rank.
- ``train.deterministic``: ``torch.use_deterministic_algorithms(True)`` before the model is built (the environment
  it needs came with env.sh: launcher/core/determinism.py).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Optional

import torch

from launcher.schema import Profiler


SNAPSHOT: Optional["MemorySnapshot"] = None
"""This rank's memory snapshot (set by the rank entry), dumped by its error handler on out-of-memory."""


def profile_dir(bundle: Path) -> Path:
    return Path(bundle) / "profile"


def set_deterministic(deterministic: bool) -> None:
    """Megatron-LM's apply_determinism_to_args, rank side: torch refuses nondeterministic kernels from here on."""
    if deterministic:
        torch.use_deterministic_algorithms(True)


class StepProfiler:
    """Opens and closes the profiler around the configured steps; ``before(step)`` and ``after(step)`` are called
    by the loop with the 1-based number of the step about to run / just run."""

    def __init__(self, *, kind: str, start: int, end: int, active: bool, bundle: Path, rank: int,
                 note=None):
        self.kind, self.start, self.end, self.active = kind, start, end, active and kind != "none"
        self.bundle, self.rank, self.note = Path(bundle), rank, note
        self._torch = None
        self._nvtx = None
        self.written: Optional[Path] = None
        self._first: Optional[int] = None  # the steps of the range this attempt ran (a requeue may resume inside it,
        self._last: Optional[int] = None   # a run may end inside it)

    @classmethod
    def for_job(cls, job, bundle: Path, rank: int, note=None) -> "StepProfiler":
        p = job.profile
        return cls(kind=p.kind, start=p.step_start, end=p.step_end, active=rank in p.ranks, bundle=bundle, rank=rank,
                   note=note)

    def before(self, step: int) -> None:
        if not self.active or self._first is not None or not self.start <= step < self.end:
            return
        self._first = step
        if self.kind == Profiler.TORCH:
            self._start_torch(step)
        elif self.kind == Profiler.NSYS and torch.cuda.is_available():
            torch.cuda.cudart().cudaProfilerStart()
            self._nvtx = torch.autograd.profiler.emit_nvtx(record_shapes=True)
            self._nvtx.__enter__()

    def after(self, step: int) -> None:
        if not self.active or self._first is None or not self.start <= step < self.end:
            return
        self._last = step
        if self._torch is not None:
            self._torch.step()
        if step == self.end - 1:
            self.close()

    def close(self) -> None:
        """Stop whatever is open (the last profiled step, or the run ended inside the range)."""
        if self._torch is not None:
            prof, self._torch = self._torch, None
            prof.stop()
            traces = sorted((profile_dir(self.bundle) / "torch").glob(f"rank{self.rank}.*.pt.trace.json"))
            self.written = traces[-1] if traces else None
            if self.note and self.written is not None:
                self.note(f"profile: torch trace of steps {self._steps()} on rank {self.rank}: {self.written}")
        if self._nvtx is not None:
            nvtx, self._nvtx = self._nvtx, None
            nvtx.__exit__(None, None, None)
            torch.cuda.cudart().cudaProfilerStop()
            if self.note:
                self.note(f"profile: nsys capture of steps {self._steps()} closed on rank {self.rank} "
                          f"({profile_dir(self.bundle)}/nsys-rank{self.rank}.nsys-rep once the rank exits)")

    def _steps(self) -> str:
        return f"{self._first}..{self._last if self._last is not None else self._first}"

    def _start_torch(self, first: int) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile, tensorboard_trace_handler

        out = profile_dir(self.bundle) / "torch"
        out.mkdir(parents=True, exist_ok=True)
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        start, end = self.start, self.end

        def schedule(step: int):  # torch counts from step_num, set to our first profiled step below
            if step < start or step >= end:
                return ProfilerAction.NONE
            return ProfilerAction.RECORD if step < end - 1 else ProfilerAction.RECORD_AND_SAVE

        prof = profile(activities=activities, schedule=schedule,
                       on_trace_ready=tensorboard_trace_handler(str(out), worker_name=f"rank{self.rank}"),
                       record_shapes=True, with_stack=False)
        # the spans read ProfilerStep#<our step number> (torch would start at #0)
        prof.step_num, prof.current_action = first, schedule(first)
        prof.start()
        self._torch = prof


class MemorySnapshot:
    """profile.memory_snapshot: the CUDA allocator's history, dumped when this rank runs out of memory."""

    def __init__(self, *, enabled: bool, entries: int, bundle: Path, rank: int):
        self.enabled = enabled and torch.cuda.is_available()
        self.entries, self.bundle, self.rank = entries, Path(bundle), rank

    def start(self) -> None:
        if self.enabled:
            torch.cuda.memory._record_memory_history(max_entries=self.entries)

    def path(self) -> Path:
        return profile_dir(self.bundle) / f"memory-rank{self.rank}.pickle"

    def dump(self) -> Optional[Path]:
        """Write the history (on out-of-memory); returns the file, or None when nothing was recorded."""
        if not self.enabled:
            return None
        path = self.path()
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(Exception):  # a failing dump must not hide the out-of-memory error itself
            torch.cuda.memory._dump_snapshot(str(path))
            return path
        return None


def is_out_of_memory(exc: BaseException) -> bool:
    oom = getattr(torch.cuda, "OutOfMemoryError", None)
    return (oom is not None and isinstance(exc, oom)) or "CUDA out of memory" in str(exc)
