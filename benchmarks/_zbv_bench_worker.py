"""torchrun worker of benchmarks/zbv_bench.py: the same job built twice in the same ranks with two chunks per rank
(Megatron's interleaved 1F1B and our ZB-V, same weights and data), trained in alternating steps so both see the
same machine load, each step recorded and timed. Megatron's interleaved schedule is recorded from outside (its
backward_step and our forward step function timed, as for 1F1B): span lengths, not chunk labels, are what counts.

Usage: torchrun --nproc_per_node=P benchmarks/_zbv_bench_worker.py OUT.json STEPS override [override ...]
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from launcher.schema import Schedule  # noqa: E402


def build(job, layout, kind: str, cache: str):
    from launcher.rank import training
    from launcher.rank import zb_executor as zb

    job = dataclasses.replace(job, schedule=dataclasses.replace(job.schedule, kind=kind, overlap_p2p_comm=False,
                                                                batch_p2p_comm=True, record_timeline=True))
    t = training.build(job, layout)  # production's own build sequence
    lp = t.loop
    if kind == Schedule.INTERLEAVED:  # Loop records 1f1b/zb only: time Megatron's interleaved the way it times 1F1B

        @contextlib.contextmanager
        def recording():
            lp.recorder.start_step()
            with zb.recording_megatron_1f1b(lp.recorder):
                yield lp.fwd_bwd, zb.recorded_forward(lp.forward_step, lp.recorder)

        lp._recording = recording
    iters, _ = t.iterators(cache_dir=cache)
    return lp, iters


def main() -> int:
    from _zb_bench_worker import main as alternate  # the same alternating loop, over these two schedules

    return alternate((Schedule.INTERLEAVED, Schedule.ZB_V), build)


if __name__ == "__main__":
    raise SystemExit(main())
