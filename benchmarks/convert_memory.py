"""Peak host memory per rank of the FSDP <-> DP checkpoint conversion (launcher/rank/checkpoint/convert.py, issue 42).

    .venv/bin/python benchmarks/convert_memory.py [--baseline GITREF] [--keep DIR] [override ...]

Trains one step of a mid-sized model (about 59 M parameters: hidden 1024, 8 layers, fp32; overrides change it) at DP2 on
2 CPU ranks twice, saving an fsdp_dtensor checkpoint (Megatron-FSDP) and a torch_dist one (Megatron DDP with the
distributed optimizer, ``fully_reshardable``), then converts each into a job of the other format, both ways, with
``checkpoint.resume`` as the training entry does (torchrun of this file in worker mode). Each rank prints its RSS
just before the load and its peak RSS during the load (VmHWM, reset through ``/proc/self/clear_refs`` right before
it: the model build's own peak does not count), and ``resource.getrusage``'s ``ru_maxrss`` (the whole process,
model build included). ``--baseline GITREF`` runs the same conversions with that commit's ``launcher`` too (a
temporary ``git worktree``, removed afterwards), in the same run, alternating, so both see the same machine load.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TREE_ENV = "CONVERT_BENCH_TREE"
"""Worker mode: the source tree whose ``launcher`` is imported (this one, or the baseline's worktree)."""
sys.path.insert(0, os.environ.get(TREE_ENV, str(ROOT)))

MODEL = ["data=mock", "model.num_layers=8", "model.hidden_size=1024", "model.ffn_hidden_size=1024",
         "model.num_attention_heads=8", "model.num_query_groups=4", "model.seq_length=64", "model.vocab_size=4096",
         "model.make_vocab_size_divisible_by=64", "train.micro_batch_size=1", "train.global_batch_size=2",
         "train.train_steps=1", "train.warmup_steps=1", "train.eval_interval=0", "logging.tensorboard=false",
         "parallel.tensor=1", "parallel.pipeline=1", "parallel.distributed_optimizer=true", "cluster.gpus_per_node=2",
         "checkpoint.save_interval=1", "checkpoint.save_at_end=false"]
FSDP = ["parallel.megatron_fsdp=true"]
DDP = ["checkpoint.optimizer_format=fully_reshardable"]


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _worker(bundle: Path) -> None:
    """One rank: build the job's model and optimizer, then load the other format's checkpoint (the conversion)."""
    import torch

    import launcher
    from launcher.core import derive, load_job
    from launcher.core.checkpoint.format import checkpoint_format
    from launcher.core.run_identity import run_identity
    from launcher.rank import setup, training
    from launcher.rank.checkpoint import store as ckpt

    job = load_job(bundle / "config.yaml")
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    t = training.build(job, layout, loop=False)  # resumed here, never trained
    model, optimizer, scheduler = t.model, t.optimizer, t.scheduler
    torch.distributed.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # peak RSS := current RSS (Linux >= 4.0)
    before = _status_kb("VmRSS")
    step, _, loaded = ckpt.resume(bundle / "unused", identity=run_identity(job), load_from=job.checkpoint.load,
                                  checksum=False, model=model, optimizer=optimizer, scheduler=scheduler, warn=print,
                                  distributed_optimizer=True, fmt=checkpoint_format(job),
                                  run_state=ckpt.CheckpointState())
    peak = _status_kb("VmHWM")
    assert loaded is not None and step == 1, (loaded, step)
    rank = torch.distributed.get_rank()
    (bundle / f"rank{rank}.json").write_text(json.dumps({
        "rank": rank, "rss_before_kb": before, "peak_kb": peak, "launcher": launcher.__file__,
        "ru_maxrss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}))
    torch.distributed.destroy_process_group()


def _bundle(path: Path, overrides: list) -> Path:
    from launcher.config import compose_job, job_to_yaml

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.yaml").write_text(job_to_yaml(compose_job(overrides)))
    return path


def _torchrun(target: list, tree: Path) -> str:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(tree),
               **{TREE_ENV: str(tree)})
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--standalone",
                           *target], cwd=tree, env=env, text=True, capture_output=True)
    if proc.returncode:
        sys.exit(f"{' '.join(target)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout


def _checkpoint(work: Path, name: str, overrides: list) -> Path:
    bundle = work / name
    ckpt = bundle / "checkpoints" / "iter_0000001"
    if not ckpt.is_dir():
        _torchrun(["-m", "launcher.rank", "--bundle", str(_bundle(bundle, MODEL + overrides))], ROOT)
    return ckpt


def _convert(work: Path, tree: Path, label: str, leg: str, overrides: list, source: Path) -> list:
    bundle = _bundle(work / f"{label}_{leg}", MODEL + overrides + [f"checkpoint.load={source}"])
    for old in bundle.glob("rank*.json"):
        old.unlink()
    _torchrun([str(Path(__file__).resolve()), "--worker", str(bundle)], tree)
    rows = [json.loads(path.read_text()) for path in bundle.glob("rank*.json")]
    assert len(rows) == 2 and all(r["launcher"].startswith(str(tree)) for r in rows), rows
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--baseline", help="a git ref whose launcher converts the same checkpoints too")
    ap.add_argument("--keep", type=Path, default=None, help="work directory (kept; checkpoints reused)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.worker:
        return _worker(args.worker)
    MODEL.extend(args.overrides)
    work = args.keep or Path(tempfile.mkdtemp(prefix="convert-bench-"))
    fsdp_ckpt, ddp_ckpt = _checkpoint(work, "fsdp_src", FSDP), _checkpoint(work, "ddp_src", DDP)
    sizes = {name: sum(p.stat().st_size for p in path.iterdir() if p.is_file()) for name, path in
             (("fsdp_dtensor", fsdp_ckpt), ("torch_dist", ddp_ckpt))}
    print(f"checkpoints: fsdp_dtensor {sizes['fsdp_dtensor'] / 1e6:.0f} MB, torch_dist {sizes['torch_dist'] / 1e6:.0f}"
          f" MB (work dir {work})")
    trees = [("this", ROOT)]
    if args.baseline:
        old = Path(tempfile.mkdtemp(prefix="convert-bench-baseline-")) / "tree"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), args.baseline], cwd=ROOT, check=True,
                       capture_output=True)
        trees.insert(0, (args.baseline, old))
    # the same jobs loading their own format (no conversion): the floor a load costs whatever the converter does
    legs = (("fsdp->ddp", DDP, fsdp_ckpt, sizes["fsdp_dtensor"], trees),
            ("ddp->ddp", DDP, ddp_ckpt, sizes["torch_dist"], trees[-1:]),
            ("ddp->fsdp", FSDP, ddp_ckpt, sizes["torch_dist"], trees),
            ("fsdp->fsdp", FSDP, fsdp_ckpt, sizes["fsdp_dtensor"], trees[-1:]))
    try:
        for leg, overrides, source, size, leg_trees in legs:
            for label, tree in leg_trees:
                for row in _convert(work, tree, label.replace("/", "_").replace("~", "_"), leg.replace(">", ""),
                                    overrides, source):
                    before, peak = row["rss_before_kb"] / 1e3, row["peak_kb"] / 1e3
                    grown = (peak - before) * 1e6
                    print(f"{leg:10} {label:10} rank {row['rank']}: RSS before load {before:7.0f} MB, peak during load"
                          f" {peak:7.0f} MB (+{grown / 1e6:5.0f} MB = {grown / size:.2f}x the {size / 1e6:.0f} MB"
                          f" source); ru_maxrss {row['ru_maxrss_kb'] / 1e3:.0f} MB")
    finally:
        if args.baseline:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=True)
            old.parent.rmdir()
    print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
