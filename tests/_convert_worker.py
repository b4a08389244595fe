"""Rank worker for tests/test_fsdp.py's exact-conversion check: build a job's model, optimizer and scheduler through
the rank's own ``launcher.rank.training.build``, resume it from ``checkpoint.load`` (a
checkpoint of the other format: launcher/rank/checkpoint/store.py ``resume`` converts it on the ranks,
launcher/rank/checkpoint/convert.py) and save it again, in this job's own format, at the step it was loaded at: no step in between, so every weight,
Adam moment, counter and RNG stream written is what the conversion put into the live model and optimizer. Rank 0
writes the model's layer-spec key map (torch_dist's stored names) to OUT/keys_map.json.
``torchrun ... _convert_worker.py BUNDLE OUT``."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def convert(bundle: Path, out: Path) -> None:
    import torch

    from launcher.core import derive, load_job
    from launcher.core.checkpoint.format import checkpoint_format
    from launcher.core.run_identity import run_identity
    from launcher.rank import setup, training
    from launcher.rank.checkpoint import store as ckpt
    from launcher.rank.checkpoint import convert as checkpoint_convert

    job = load_job(bundle / "config.yaml")
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    t = training.build(job, layout, loop=False)  # resumed and saved here, never trained
    model, optimizer, scheduler = t.model, t.optimizer, t.scheduler
    identity, fmt = run_identity(job), checkpoint_format(job)
    step, consumed, loaded = ckpt.resume(out / "unused", identity=identity, load_from=job.checkpoint.load,
                                         checksum=False, model=model, optimizer=optimizer, scheduler=scheduler,
                                         warn=print, distributed_optimizer=job.parallel.distributed_optimizer,
                                         fmt=fmt, run_state=ckpt.CheckpointState())
    assert loaded is not None and step > 0, (loaded, step)
    ckpt.save(out / "converted", model=model, optimizer=optimizer, scheduler=scheduler, step=step, consumed=consumed,
              identity=identity, optimizer_format=job.checkpoint.optimizer_format, fmt=fmt)
    if torch.distributed.get_rank() == 0:
        (out / "keys_map.json").write_text(json.dumps(checkpoint_convert.keys_map_of(model)))
    torch.distributed.barrier()


def main(bundle: str, out: str) -> None:
    import torch

    try:
        convert(Path(bundle), Path(out))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
