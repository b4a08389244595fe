"""The planner's parameter, gradient and optimizer bytes per rank equal what Megatron-Core really allocates.

Four CPU processes (gloo) build a real ``GPTModel`` (local spec) for several layouts of the smoke model, wrap it
in Megatron's ``DistributedDataParallel`` (the gradient buffer) and build Megatron's optimizer with its state
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
    ("moe_ep2_bf16_distopt", ["parallel.tensor=1", "parallel.pipeline=1", "parallel.expert=2",
                              "precision.dtype=bf16", "parallel.distributed_optimizer=true",
                              "model.num_experts=4", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=96",
                              "model.moe_shared_expert_intermediate_size=64", "model.moe_first_k_dense=1"]),
]


def _spec(overrides):
    """What a worker needs to build the model, taken from the composed job (not re-typed here)."""
    from launcher.config import compose_job

    job = compose_job(["recipe=smoke", *overrides])
    from launcher.plan.flops import moe_layer_pattern
    from launcher.plan.memory import padded_vocab

    return {"model": vars(job.model), "parallel": vars(job.parallel), "dtype": job.precision.dtype,
            "moe_pattern": [int(x) for x in moe_layer_pattern(job.model)],
            "padded_vocab": padded_vocab(job.model, job.parallel.tensor)}


# ----------------------------------------------------------------------------------- child side (torch)
def _bridge_cpu():
    """Just enough CUDA bridging to construct (not train) Megatron modules on CPU torch."""
    import torch
    from torch.overrides import TorchFunctionMode

    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.Stream = lambda *a, **k: None  # MoE all-to-all dispatcher's D2H stream (unused here)

    class CpuDevice(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.type and len(args) == 1 and not kwargs:
                name = func(*args)  # megatron checks 'torch.cuda.*Tensor' type names
                return name if ".cuda." in name else name.replace("torch.", "torch.cuda.", 1)
            if func is torch.Tensor.cuda:
                return args[0]
            if "cuda" in str(kwargs.get("device", "")):
                kwargs["device"] = "cpu"
            return func(*args, **kwargs)

    CpuDevice().__enter__()


def _measure(spec):
    import torch
    import torch.nn.functional as F
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    m, par = spec["model"], spec["parallel"]
    bf16 = spec["dtype"] == "bf16"
    dtype = torch.bfloat16 if bf16 else torch.float32
    ps.initialize_model_parallel(par["tensor"], par["pipeline"], expert_model_parallel_size=par["expert"])
    model_parallel_cuda_manual_seed(1, inference_rng_tracker=True)
    moe = {}
    if m["num_experts"]:
        moe = dict(num_moe_experts=m["num_experts"], moe_router_topk=m["moe_router_topk"],
                   moe_ffn_hidden_size=m["moe_ffn_hidden_size"], moe_layer_freq=spec["moe_pattern"],
                   moe_shared_expert_intermediate_size=m["moe_shared_expert_intermediate_size"],
                   expert_model_parallel_size=par["expert"], moe_token_dispatcher_type="alltoall")
    cfg = TransformerConfig(
        num_layers=m["num_layers"], hidden_size=m["hidden_size"], ffn_hidden_size=m["ffn_hidden_size"],
        num_attention_heads=m["num_attention_heads"], num_query_groups=m["num_query_groups"],
        kv_channels=m["kv_channels"], normalization=m["normalization"],
        gated_linear_unit=m["activation"] == "swiglu",
        activation_func=F.silu if m["activation"] == "swiglu" else F.gelu, add_bias_linear=m["add_bias_linear"],
        use_cpu_initialization=True, tensor_model_parallel_size=par["tensor"],
        pipeline_model_parallel_size=par["pipeline"], num_layers_in_first_pipeline_stage=par["first_stage_layers"],
        num_layers_in_last_pipeline_stage=par["last_stage_layers"], bf16=bf16, params_dtype=dtype,
        pipeline_dtype=dtype, **moe)
    if m["num_experts"]:  # the block spec picks dense or MoE per layer (moe_layer_freq)
        layer_spec = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False, normalization=m["normalization"],
                                                pp_rank=ps.get_pipeline_model_parallel_rank())
    else:
        layer_spec = get_gpt_layer_local_spec(normalization=m["normalization"])
    model = GPTModel(
        config=cfg, transformer_layer_spec=layer_spec,
        vocab_size=spec["padded_vocab"],  # padded, as Megatron's training (and our model builder) does
        max_sequence_length=m["seq_length"],
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=m["tie_embeddings"], position_embedding_type=m["position_embedding"])
    model = model.to(dtype)
    params = sum(p.numel() for p in model.parameters())
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=par["distributed_optimizer"]), model)
    grads = sum(b.grad_data.numel() * b.grad_data.element_size() for b in ddp.buffers + ddp.expert_parallel_buffers)
    opt = get_megatron_optimizer(OptimizerConfig(lr=1e-3, bf16=bf16,
                                                 use_distributed_optimizer=par["distributed_optimizer"]), [ddp])
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

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _bridge_cpu()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results = {name: _measure(spec) for name, spec in specs.items()}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def _main(spec_file, out_dir):
    import socket
    import warnings

    import torch.multiprocessing as mp

    warnings.filterwarnings("ignore")
    specs = json.loads(Path(spec_file).read_text())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(WORLD, port, specs, out_dir), nprocs=WORLD)


# ------------------------------------------------------------------------------------ test side (no torch)
@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("needs torch and megatron-core (the rank-side extra)")
    tmp = tmp_path_factory.mktemp("memreal")
    specs = {name: _spec(ov) for name, ov in LAYOUTS}
    (tmp / "specs.json").write_text(json.dumps(specs))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
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
