"""torchrun worker for tests/test_rank_seeds.py: each pipeline stage's seed and a fingerprint of its first
transformer layer's weights, built on the CPU init path and on the GPU init path (``use_cpu_initialization=False``,
every weight drawn inside Megatron's RNG tracker as on a GPU rank, here through the CPU bridge).

Usage: torchrun --nproc_per_node=N tests/_seed_worker.py OUT_DIR override [override ...]
"""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def first_layer_weights(job, layout, gpu_init: bool) -> list:
    import torch

    import models.builder as builder

    original = builder.transformer_config

    def config(**kwargs):
        made = original(**kwargs)
        return dataclasses.replace(made, use_cpu_initialization=False) if gpu_init else made

    builder.transformer_config = config
    try:
        chunk = builder.build_model(model=job.model, parallel=job.parallel, precision=job.precision, layout=layout,
                                    schedule=job.schedule, seed=job.train.seed)[0]
    finally:
        builder.transformer_config = original
    weight = chunk.decoder.layers[0].self_attention.linear_qkv.weight
    return [float(x) for x in weight.detach().float().flatten()[:16]]


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    import torch
    from megatron.core import parallel_state as ps

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import setup

    job = compose_job(overrides)
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    report = {"pp_rank": ps.get_pipeline_model_parallel_rank(), "seed": job.train.seed,
              "torch_seed": torch.initial_seed()}
    report["cpu_init"] = first_layer_weights(job, layout, gpu_init=False)
    report["gpu_init"] = first_layer_weights(job, layout, gpu_init=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{torch.distributed.get_rank()}.json").write_text(json.dumps(report))
    setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
