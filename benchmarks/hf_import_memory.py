"""Peak memory of ``import-hf`` (issue 42): streaming against its stated bound, and against the importer before it.

The same random Llama-style model as benchmarks/hf_export_memory.py (6 layers, hidden 2048, 32k vocabulary: fp32,
about 1.6 GB; made with transformers on the CPU) is imported by ``python -m launcher import-hf`` in a fresh process,
once with this checkout and, with ``--baseline REV``, once with the launcher at git revision REV (extracted with
``git archive`` into a temporary directory, run with the same interpreter). Each child reports its own peak resident
memory (VmHWM, which starts afresh at exec) when it exits; this checkout's import also prints its report (its RSS
before reading a tensor, the largest tensor group, the bound). The two checkpoints are compared tensor by tensor.

    .venv/bin/python benchmarks/hf_import_memory.py [--layers 6] [--keep DIR] [--baseline REV]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_export_memory import OURS, SHAPE  # noqa: E402 - the same model as the export benchmark

ROOT = Path(__file__).resolve().parents[1]
WRAP = ("import atexit, runpy, sys\n"
        "def hwm():\n"
        "    line = [x for x in open('/proc/self/status') if x.startswith('VmHWM:')][0]\n"
        "    print('child-peak-rss-bytes', int(line.split()[1]) * 1024, flush=True)\n"
        "atexit.register(hwm)\n"
        "sys.argv = ['launcher', *sys.argv[1:]]\n"
        "runpy.run_module('launcher', run_name='__main__', alter_sys=True)\n")
"""The child: ``python -m launcher ...`` that prints its own VmHWM at exit (``sys.exit`` runs atexit handlers)."""


def run_import(tree: Path, hf_dir: Path, out: Path, layers: int) -> dict:
    start = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", WRAP, "import-hf", "--hf", str(hf_dir), "--output", str(out),
                          *OURS, f"model.num_layers={layers}"], cwd=tree, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(tree)})
    if res.returncode != 0:
        raise SystemExit(f"import-hf in {tree} failed:\n{res.stderr[-3000:]}")
    lines = res.stdout.splitlines()
    peak = int([x for x in lines if x.startswith("child-peak-rss-bytes")][-1].split()[1])
    report = [json.loads(x[len("import-report "):]) for x in lines if x.startswith("import-report ")]
    return {"peak": peak, "seconds": time.perf_counter() - start, "report": report[-1] if report else None}


def checkout(rev: str, into: Path) -> Path:
    tar = into / "src.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(tar), rev], cwd=ROOT, check=True)
    with tarfile.open(tar) as t:
        t.extractall(into / "tree", filter="data")
    tar.unlink()
    return into / "tree"


def same_tensors(a: Path, b: Path) -> bool:
    import torch

    from launcher.hf.torch_dist import Reader

    ra, rb = Reader(a), Reader(b)
    if ra.model_keys() != rb.model_keys():
        return False
    return all(torch.equal(ra.read(k), rb.read(k)) for k in ra.model_keys())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--keep", type=Path, default=None)
    ap.add_argument("--baseline", default=None, help="a git revision whose import-hf to measure as well")
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="hf-import-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    hf_dir = work / "hf"
    if not hf_dir.exists():
        import torch
        from transformers import AutoModelForCausalLM, LlamaConfig

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=args.layers, **SHAPE),
                                                 dtype=torch.float32)
        model.save_pretrained(str(hf_dir))
        del model
    hf_bytes = sum(p.stat().st_size for p in hf_dir.glob("*.safetensors"))
    print(f"HF model {hf_bytes / 1e9:.2f} GB ({args.layers} layers, fp32); load {os.getloadavg()[0]:.1f}; "
          f"work dir {work}", flush=True)
    stamp = int(time.time())
    ours = run_import(ROOT, hf_dir, work / f"new-{stamp}", args.layers)
    r = ours["report"]
    print(f"streaming import-hf: peak RSS {ours['peak'] / 1e6:.0f} MB = {ours['peak'] / hf_bytes:.2f}x the model; "
          f"{r['rss_before_reading_bytes'] / 1e6:.0f} MB before reading a tensor + "
          f"{(r['peak_rss_bytes'] - r['rss_before_reading_bytes']) / 1e6:.0f} MB (largest tensor group "
          f"{r['largest_group_bytes'] / 1e6:.0f} MB; stated bound {r['bound_bytes'] / 1e6:.0f} MB); "
          f"{ours['seconds']:.0f} s; load {os.getloadavg()[0]:.1f}", flush=True)
    if args.baseline:
        with tempfile.TemporaryDirectory(prefix="hf-import-base-") as tmp:
            tree = checkout(args.baseline, Path(tmp))
            base = run_import(tree, hf_dir, work / f"base-{stamp}", args.layers)
        print(f"import-hf at {args.baseline}: peak RSS {base['peak'] / 1e6:.0f} MB = {base['peak'] / hf_bytes:.2f}x "
              f"the model; {base['seconds']:.0f} s; load {os.getloadavg()[0]:.1f}", flush=True)
        same = same_tensors(work / f"new-{stamp}" / "iter_0000000", work / f"base-{stamp}" / "iter_0000000")
        print(f"the two checkpoints hold the same tensors: {same}")


if __name__ == "__main__":
    main()
