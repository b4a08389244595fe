"""torchrun worker for tests/test_zb_memory.py: one ZB-H1 training step on the real executor; what the W store
(models/deferred_wgrad.py) held at most, per rank.

Usage: torchrun --nproc_per_node=N tests/_zb_memory_worker.py OUT_DIR override [override ...]
Writes OUT_DIR/rank-<r>.json: pipeline and TP rank, the store's peak bytes and peak pending microbatches over
the step (``STORE.peak_bytes`` / ``peak_microbatches``; the executor clears the store when a step starts), and
what it still held after the step (0 when every W ran).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    import torch
    from megatron.core import parallel_state as ps

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import loop, setup, training
    from models.deferred_wgrad import STORE

    job = compose_job(overrides)
    layout = derive(job)
    assert job.schedule.kind == "zb_h1", job.schedule.kind
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    # production's own build sequence (recompute, determinism and backend checks included)
    t = training.build(job, layout, loop=False)  # this worker drives the schedule itself
    model, optimizer = t.model, t.optimizer
    iters, _ = t.iterators(cache_dir=str(out / "cache"))
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward = loop.forward_step_for(micro_batch_size=job.train.micro_batch_size, seq_length=job.model.seq_length)
    loop.schedule_func("zb_h1")(forward_step_func=forward, data_iterator=iters[0], model=model,
                                num_microbatches=layout.microbatches, seq_length=job.model.seq_length,
                                micro_batch_size=job.train.micro_batch_size, forward_only=False)
    report = {"pp": ps.get_pipeline_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_rank(),
              "peak_bytes": STORE.peak_bytes, "peak_microbatches": STORE.peak_microbatches,
              "held_after_step": STORE.held_bytes, "microbatches": layout.microbatches}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{torch.distributed.get_rank()}.json").write_text(json.dumps(report))
    setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
