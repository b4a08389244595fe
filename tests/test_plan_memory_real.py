"""The planner's parameter, gradient and optimizer bytes per rank equal what Megatron-Core really allocates.

Four CPU processes (gloo) build the model for several layouts of the smoke model through the rank entry's own
build sequence (``launcher.rank.training.build``: a real ``GPTModel``, Megatron's
``DistributedDataParallel`` gradient buffer, Megatron's optimizer) with its state
initialised (``init_state_fn``: Adam moments, plus fp32 master copies for bf16). Each rank reports its bytes;
the planner's prediction for that rank's pipeline stage must agree within 1%.

torch and megatron are imported only in the child processes (this file run as a script), never in pytest's
process: the planner's own tests check that the login-node code does not import them.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORLD = 4

# (name, overrides on top of recipe=smoke): each runs on 4 CPU ranks.
LAYOUTS = [
    ("smoke_tp2_pp2", []),
    ("tp1_pp1", ["parallel.tensor=1", "parallel.pipeline=1"]),
    ("tp2_pp1", ["parallel.tensor=2", "parallel.pipeline=1"]),
    ("tp2_pp1_bf16_distopt", ["parallel.tensor=2", "parallel.pipeline=1", "precision.dtype=bf16",
                              "parallel.distributed_optimizer=true"]),
    ("tp1_pp2_uneven_tied_bf16_distopt", ["parallel.tensor=1", "parallel.pipeline=2", "precision.dtype=bf16",
                                          "parallel.distributed_optimizer=true", "parallel.first_stage_layers=1",
                                          "parallel.last_stage_layers=3", "model.tie_embeddings=true"]),
    ("tp2_gelu_layernorm_bias", ["parallel.tensor=2", "parallel.pipeline=1", "model.activation=gelu",
                                 "model.normalization=LayerNorm", "model.add_bias_linear=true",
                                 "model.vocab_size=8000"]),
    ("tp2_pp1_bf16_distopt_bf16_grads", ["parallel.tensor=2", "parallel.pipeline=1", "precision.dtype=bf16",
                                         "parallel.distributed_optimizer=true", "precision.grad_reduce_in_fp32=false"]),
    ("moe_ep2_bf16_distopt", ["parallel.tensor=1", "parallel.pipeline=1", "parallel.expert=2",
                              "precision.dtype=bf16", "parallel.distributed_optimizer=true",
                              "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=96",
                              "model.moe_shared_expert_intermediate_size=64", "model.moe_first_k_dense=1"]),
]


def _job_yaml(overrides) -> str:
    """The composed job as a bundle's config.yaml: the workers build from it with the launcher's own builders."""
    from launcher.config import compose_job, job_to_yaml

    return job_to_yaml(compose_job(["recipe=smoke", f"cluster.gpus_per_node={WORLD}", *overrides]))


# ----------------------------------------------------------------------------------- child side (torch)
def _measure(config_yaml: str, tmp: str):
    """Build this rank's model exactly as the rank wing does (launcher.rank.training.build),
    then count the bytes Megatron-Core allocated for weights, the DDP gradient buffer and the optimizer state."""
    import torch
    from megatron.core import parallel_state as ps

    from launcher.core import derive, load_job
    from launcher.rank import setup, training

    path = Path(tmp) / f"job-{os.getpid()}.yaml"
    path.write_text(config_yaml)
    job = load_job(path)
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    t = training.build(job, layout, loop=False)  # production's own build sequence
    model, opt = t.model, t.optimizer
    chunks = [ddp.module for ddp in model]  # the GPTModel chunks inside the DDP wrappers
    params = sum(p.numel() for c in chunks for p in c.parameters())
    weights = sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())
    grads = sum(b.grad_data.numel() * b.grad_data.element_size()
                for ddp in model for b in ddp.buffers + ddp.expert_parallel_buffers)
    optimizer = 0
    for o in getattr(opt, "chained_optimizers", [opt]):
        o.init_state_fn(o.optimizer, o.config)
        for state in o.optimizer.state.values():
            optimizer += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))
        for name in ("fp32_from_float16_groups", "shard_fp32_from_float16_groups"):
            for group in getattr(o, name, []):
                optimizer += sum(p.numel() * p.element_size() for p in group)
    stage = ps.get_pipeline_model_parallel_rank()
    ps.destroy_model_parallel()
    return {"stage": stage, "params": params, "weights": weights, "grads": grads, "optimizer": optimizer}


def _worker(rank, world, port, specs, out_dir):
    import torch.distributed as dist

    from _rendezvous import join

    join(port, rank, world)
    results = {name: _measure(spec, out_dir) for name, spec in specs.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _main(spec_file, out_dir):
    import warnings

    import torch.multiprocessing as mp

    warnings.filterwarnings("ignore")
    specs = json.loads(Path(spec_file).read_text())
    from _rendezvous import host

    store = host(WORLD)  # served here while the spawned ranks run
    mp.spawn(_worker, args=(WORLD, store.port, specs, out_dir), nprocs=WORLD)


# ------------------------------------------------------------------------------------ test side (no torch)
@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch and megatron-core (the rank-side extra)")
    tmp = tmp_path_factory.mktemp("memreal")
    specs = {name: _job_yaml(ov) for name, ov in LAYOUTS}
    (tmp / "specs.json").write_text(json.dumps(specs))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT}{os.pathsep}{ROOT / 'tests'}")
    proc = subprocess.run([sys.executable, __file__, str(tmp / "specs.json"), str(tmp)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name,overrides", LAYOUTS, ids=[n for n, _ in LAYOUTS])
def test_predicted_static_bytes_match_megatron(measured, name, overrides):
    from launcher.config import compose_job
    from launcher.plan.memory import stage_params, static_bytes

    job = compose_job(["recipe=smoke", *overrides])
    for rank, per_rank in enumerate(measured):
        real = per_rank[name]
        rp = stage_params(job, real["stage"])
        pred = static_bytes(job, rp)
        got = {"params": rp.total, "weights": pred["weights"], "grads": pred["grads"], "optimizer": pred["optimizer"]}
        for key, value in got.items():
            assert value == pytest.approx(real[key], rel=0.01), (name, rank, key, value, real[key])


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
