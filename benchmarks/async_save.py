"""checkpoint.async_save on CPU: the wall time of the step that saves, and of the steps while an asynchronous save is
written, against a synchronous save, in the same ranks (same model, same machine load: sync and async saves
alternate in one run).

    python benchmarks/async_save.py [--rounds 5] [override ...]

Starts ``torchrun --nproc_per_node=2`` of this file (gloo, DP2, one thread per rank). Each round: a synchronous save
(the saving step = its train step + the blocking save), some plain steps, an asynchronous save (the saving step = its
train step + staging and starting the writer; then steps until the writer's checkpoint is published, each polling as
the training loop does). Prints medians over the rounds; rank 0's numbers (every rank waits for the others in each
step's collectives anyway).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODEL = ["data=mock", "model.num_layers=4", "model.hidden_size=256", "model.ffn_hidden_size=1024",
         "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=64", "model.vocab_size=8192",
         "train.micro_batch_size=2", "train.global_batch_size=8", "train.train_steps=1000", "train.warmup_steps=1",
         "logging.tensorboard=false", "parallel.tensor=1", "parallel.pipeline=1", "cluster.gpus_per_node=2"]
"""A small default (about 7 M parameters); overrides on the command line make it larger."""


def _worker(out: Path, rounds: int, overrides: list) -> int:
    import torch

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import setup, training
    from launcher.rank.checkpoint import store as ckpt
    from launcher.rank.checkpoint.async_save import AsyncSaves

    job = compose_job(overrides)
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    t = training.build(job, layout)
    model, optimizer, scheduler, lp = t.model, t.optimizer, t.scheduler, t.loop
    iters, _ = t.iterators(cache_dir=str(out.parent / "cache"))
    ckpt_dir = out.parent / "checkpoints"
    background = AsyncSaves()
    rec = {"plain": [], "sync_save_step": [], "async_save_step": [], "during_async": []}

    def step(save: str = "") -> float:
        """One training step (its poll included); with ``save`` ("sync" or "async") the save at its end too."""
        torch.distributed.barrier()
        start = time.perf_counter()
        res = lp.train_step(iters)
        loop.reduce_report(res["local_loss"], None, job.schedule.kind)
        background.poll()  # every step, as the entry does
        if save:
            ckpt.save(ckpt_dir, model=model, optimizer=optimizer, scheduler=scheduler, step=lp.step,
                      consumed=lp.consumed, keep_last=1, identity={},
                      background=background if save == "async" else None)
        return time.perf_counter() - start

    for _ in range(3):  # warm-up (the first save also starts the writers' results-queue server)
        step()
    step("sync")
    for _ in range(rounds):
        rec["plain"] += [step() for _ in range(3)]
        rec["sync_save_step"].append(step("sync"))
        rec["plain"] += [step() for _ in range(2)]
        rec["async_save_step"].append(step("async"))
        while background.in_flight():
            rec["during_async"].append(step())
    background.wait()
    background.close()
    if torch.distributed.get_rank() == 0:
        from launcher.core.checkpoint.directory import latest_checkpoint

        newest = latest_checkpoint(ckpt_dir)
        rec["checkpoint_mb"] = sum(f.stat().st_size for f in newest.rglob("*") if f.is_file()) / 1e6
        rec["params_m"] = sum(p.numel() for chunk in model for p in chunk.parameters()) / 1e6
        out.write_text(json.dumps(rec))
    setup.close()
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    rounds = 5
    if argv[:1] == ["--rounds"]:
        rounds, argv = int(argv[1]), argv[2:]
    with tempfile.TemporaryDirectory(prefix="async-save-bench-") as tmp:
        out = Path(tmp) / "out.json"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone", __file__,
               "--worker", str(out), str(rounds), *MODEL, *argv]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            print(proc.stdout[-3000:], proc.stderr[-5000:], sep="\n")
            return proc.returncode
        rec = json.loads(out.read_text())
    size_mb, params_m = rec.pop("checkpoint_mb"), rec.pop("params_m")
    ms = {k: [v * 1e3 for v in vals] for k, vals in rec.items()}
    med = {k: statistics.median(v) if v else float("nan") for k, v in ms.items()}
    print(f"async_save benchmark: 2 CPU ranks (gloo, DP2), {params_m:.1f} M parameters, checkpoint {size_mb:.0f} MB, "
          f"{rounds} rounds, medians (ms)")
    print(f"  plain step (no save in flight):          {med['plain']:8.1f}  (n={len(ms['plain'])})")
    print(f"  step that saves, synchronous save:        {med['sync_save_step']:8.1f}  (n={len(ms['sync_save_step'])})")
    print(f"  step that saves, asynchronous save:       {med['async_save_step']:8.1f}  (n={len(ms['async_save_step'])})")
    print(f"  step while the async save is written:     {med['during_async']:8.1f}  (n={len(ms['during_async'])}, "
          f"{len(ms['during_async']) / max(rounds, 1):.1f} steps per save)")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        raise SystemExit(_worker(Path(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]))
    raise SystemExit(main())
