"""GPU proxy benchmark: the smoke architecture at Llama3-8B width on one GPU, with our own model builder,
Megatron-Core DDP + optimizer and the no-pipelining schedule. Prints tokens/s, TFLOP/s (Megatron FLOPs
formula from launcher.core.flops), MFU against --peak (989 TFLOP/s dense BF16 for H100/H200) and peak memory.

Target machine: one H200, Python 3.12, torch 2.11, no megatron-core, no Transformer Engine, no network.
Carry the cp312 megatron-core wheel along and pass it with --wheel (installed with --no-deps into a temp
dir); e.g. fetch it beforehand with
    pip download megatron-core==0.19.2 --no-deps --only-binary=:all: --python-version 3.12 -d wheels/
Hydra is only needed for recipe composition; if absent, a stub ConfigStore keeps launcher.schema importable.

    python benchmarks/gpu_proxy.py --wheel wheels/megatron_core-0.19.2-cp312-*.whl      # H200, ~2 min
    python benchmarks/gpu_proxy.py --tiny                                               # CPU check, ~10 s
"""
from __future__ import annotations

import argparse
import glob
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny sizes for a CPU smoke check")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=14336)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--microbatches", type=int, default=2, help="micro-batches per step (grad accumulation)")
    p.add_argument("--steps", type=int, default=8, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--peak", type=float, default=989.0, help="peak dense TFLOP/s for MFU")
    p.add_argument("--wheel", default=None, help="megatron-core wheel to use if megatron is not installed")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.hidden, args.ffn, args.heads, args.groups = 2, 64, 176, 4, 2
        args.vocab, args.seq, args.steps, args.warmup, args.microbatches = 1024, 128, 3, 1, 2
    return args


def _ensure_imports(wheel) -> None:
    """megatron.core from a carried wheel if not installed; a stub hydra ConfigStore if hydra is absent."""
    sys.path.insert(0, str(ROOT))
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        paths = glob.glob(wheel) if wheel else []
        if not paths:
            sys.exit("megatron-core is not installed; pass --wheel path/to/megatron_core-*.whl")
        target = tempfile.mkdtemp(prefix="mcore-")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                        "--target", target, paths[0]], check=True)
        sys.path.insert(0, target)
    try:
        import hydra.core.config_store  # noqa: F401
    except ImportError:
        store = types.ModuleType("hydra.core.config_store")
        store.ConfigStore = type("ConfigStore", (), {"instance": staticmethod(lambda: None)})
        for name in ("hydra", "hydra.core"):
            sys.modules[name] = types.ModuleType(name)
        sys.modules["hydra.core.config_store"] = store


def _job(args, on_gpu: bool):
    """The proxy as a typed job of one rank (the same schema and derived layout the launcher's jobs use); no
    activation recompute (the schema's default is selective): the proxy measures the plain forward and backward."""
    from launcher.schema import (ClusterConfig, JobConfig, ModelConfig, ParallelConfig, PrecisionConfig, Recompute,
                                 TrainConfig)

    model = ModelConfig(
        name="smoke@llama3-8b-width", num_layers=args.layers, hidden_size=args.hidden, ffn_hidden_size=args.ffn,
        num_attention_heads=args.heads, num_query_groups=args.groups, vocab_size=args.vocab,
        seq_length=args.seq, normalization="RMSNorm", activation="swiglu", position_embedding="rope",
        rotary_base=500000.0, tie_embeddings=False)
    return JobConfig(
        model=model, cluster=ClusterConfig(gpus_per_node=1, backend="nccl" if on_gpu else "gloo"),
        parallel=ParallelConfig(distributed_optimizer=False, overlap_grad_reduce=False, overlap_param_gather=False),
        precision=PrecisionConfig(dtype=args.dtype, transformer_engine="false"),
        train=TrainConfig(micro_batch_size=args.micro_batch, global_batch_size=args.micro_batch * args.microbatches,
                          lr=1e-4, min_lr=1e-5, warmup_steps=0, train_steps=args.warmup + args.steps,
                          recompute=Recompute.NONE))


def main(argv=None) -> dict:
    args = _parse(argv)
    _ensure_imports(args.wheel)
    import torch

    from launcher.core import derive
    from launcher.core.flops import flops_per_token
    from launcher.rank import setup, training
    from launcher.rank.metrics import memory_gib

    on_gpu = torch.cuda.is_available()
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                       ("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0")):
        os.environ.setdefault(key, value)
    job = _job(args, on_gpu)
    layout, train = derive(job), job.train
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=train.seed)
    t = training.build(job, layout)  # production's own build sequence (the job's schedule: 1F1B)
    model, lp = t.model, t.loop
    data = [_batches(args)]
    sync = torch.cuda.synchronize if on_gpu else (lambda: None)
    losses = []
    for _ in range(args.warmup):
        losses.append(lp.train_step(data)["local_loss"])
    sync()
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(args.steps):
        losses.append(lp.train_step(data)["local_loss"])
    sync()
    elapsed = (time.perf_counter() - start) / args.steps
    tokens = layout.tokens_per_step
    fpt = flops_per_token(job.model)
    tflops = fpt * tokens / elapsed / 1e12
    result = {
        "device": torch.cuda.get_device_name() if on_gpu else "cpu", "torch": torch.__version__,
        "params_billion": sum(p.numel() for p in model[0].module.parameters()) / 1e9, "layers": args.layers,
        "hidden": args.hidden, "seq": args.seq, "dtype": args.dtype, "tokens_per_step": tokens,
        "ms_per_step": elapsed * 1e3, "tokens_per_s": tokens / elapsed, "gflop_per_token": fpt / 1e9,
        "tflops": tflops, "mfu": tflops / args.peak, "peak_tflops": args.peak,
        "peak_memory_gib": memory_gib(), "first_loss": losses[0], "last_loss": losses[-1],
    }
    print(json.dumps(result, indent=2), flush=True)
    setup.close()
    return result


def _batches(args):
    """Random tokens (throughput only); labels = next token."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.micro_batch, args.seq + 1), generator=gen)
    batch = {"tokens": tokens[:, :-1].to(dev), "labels": tokens[:, 1:].to(dev),
             "loss_mask": torch.ones(args.micro_batch, args.seq, device=dev),
             "position_ids": torch.arange(args.seq, device=dev).expand(args.micro_batch, -1)}
    while True:
        yield batch


if __name__ == "__main__":
    main()
