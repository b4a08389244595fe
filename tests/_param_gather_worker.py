"""torchrun worker for tests/test_rank_param_sync.py: the distributed optimizer's overlapped parameter all-gather
(forward pre-hooks) around the first training step, through ``Loop.run``.

Usage: torchrun --nproc_per_node=N tests/_param_gather_worker.py OUT_DIR override [override ...]

``parallel.overlap_param_gather`` is honoured on CPU here (the launcher turns it off without CUDA streams: the
all-gather then runs inside ``optimizer.step()``); gloo runs Megatron DDP's asynchronous all-gathers as well. The job
trains twice from the same initialisation: with the overlapped gather as composed, then with it off (the CPU
default, the reference losses). Per step of the first run: whether DDP's forward pre-hooks were registered and
``config.param_sync_func`` set when the step started, and how many bucket all-gathers the pre-hooks waited on
during the step (``finish_param_sync`` calls). Writes OUT_DIR/rank-<r>.json.
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

FINISHED: list = []
"""One entry per ``finish_param_sync`` call (a forward pre-hook waiting on a bucket's parameter all-gather)."""


def _record_gathers() -> None:
    from megatron.core.distributed import param_and_grad_buffer as pgb

    finish = pgb._ParamAndGradBucketGroup.finish_param_sync

    def recorded(self, *args, **kwargs):
        FINISHED.append(1)
        return finish(self, *args, **kwargs)

    pgb._ParamAndGradBucketGroup.finish_param_sync = recorded


def _train(job, layout, cache: Path, overlap: bool) -> dict:
    from megatron.core.utils import get_model_config

    from launcher.rank import loop, optim, training

    optim._overlap_param_gather = lambda parallel, on_gpu: overlap  # DDP's and the optimizer's (they must agree)
    t = training.build(job, layout)  # production's own build sequence
    model, lp = t.model, t.loop
    iters, valid = t.iterators(cache_dir=str(cache))
    config = get_model_config(model[0])
    steps, losses = [], []
    train_step = lp.train_step

    def recorded_step(iterators):
        state = {"hooks": any(len(getattr(c, "remove_forward_pre_hook_handles", {})) > 0 for c in model),
                 "param_sync_func": config.param_sync_func is not None}
        FINISHED.clear()
        out = train_step(iterators)
        steps.append({**state, "gathers_waited": len(FINISHED)})
        return out

    lp.train_step = recorded_step
    lp.save_interval = 0  # no checkpoint dir here
    why = lp.run(iters, valid, loop.Hooks(on_step=lambda r: losses.append(r["loss"])))
    return {"why": why, "steps": steps, "losses": losses,
            "hooks_after_run": any(len(getattr(c, "remove_forward_pre_hook_handles", {})) > 0 for c in model),
            "param_sync_func_after_run": config.param_sync_func is not None,
            "overlap_param_gather": bool(model[0].ddp_config.overlap_param_gather)}


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    import torch

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import setup

    job = compose_job(overrides)
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    _record_gathers()
    report = {"overlapped": _train(job, layout, out / "cache", overlap=True),
              "reference": _train(dataclasses.replace(job), layout, out / "cache", overlap=False)}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{torch.distributed.get_rank()}.json").write_text(json.dumps(report, indent=1))
    setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
