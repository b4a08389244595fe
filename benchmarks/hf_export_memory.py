"""Peak memory of ``export-hf`` against the largest tensor group and the checkpoint size (issue 23).

A random Llama-style model of about 400M parameters (fp32: a 1.6 GB checkpoint) is made with transformers,
imported with ``import-hf`` (a torch_dist checkpoint), then exported by ``python -m launcher export-hf`` in a fresh
process, whose own report line is printed with the sizes: its peak RSS (VmHWM), its peak RSS before the first
tensor is read (torch, transformers, the checkpoint's metadata: the floor), and the largest tensor group (one
Megatron-Core tensor plus the HF tensors it splits into, an upper bound: a slice that is a view counts twice).

    .venv/bin/python benchmarks/hf_export_memory.py [--layers 6] [--keep DIR]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_attention_heads=16,
             num_key_value_heads=4, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5,
             tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
OURS = ["model.vocab_size=32000", "model.hidden_size=2048", "model.ffn_hidden_size=5632",
        "model.num_attention_heads=16", "model.num_query_groups=4", "model.seq_length=4096",
        "model.norm_epsilon=1e-5", "model.rotary_base=500000", "model.tie_embeddings=false", "precision.dtype=fp32",
        "data=mock", "model.rope_scaling=false"]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--keep", type=Path, default=None)
    args = ap.parse_args()
    work = args.keep or Path(tempfile.mkdtemp(prefix="hf-export-bench-"))
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    hf_dir = work / "hf"
    if not hf_dir.exists():
        model = AutoModelForCausalLM.from_config(LlamaConfig(num_hidden_layers=args.layers, **SHAPE),
                                                 dtype=torch.float32)
        model.save_pretrained(str(hf_dir))
        del model
    ckpt = work / "ckpt"
    if not (ckpt / "iter_0000000").exists():
        subprocess.run([sys.executable, "-m", "launcher", "import-hf", "--hf", str(hf_dir), "--output", str(ckpt),
                        *OURS, f"model.num_layers={args.layers}"], cwd=ROOT, check=True)
    out = work / f"out-{int(time.time())}"
    res = subprocess.run([sys.executable, "-m", "launcher", "export-hf", "--checkpoint", str(ckpt / "iter_0000000"),
                          "--output", str(out), "--max-shard-size", "1GB"], cwd=ROOT, check=True, text=True,
                         capture_output=True)
    line = [x for x in res.stdout.splitlines() if x.startswith("exported")][-1]
    print(line)
    ckpt_bytes = sum(p.stat().st_size for p in (ckpt / "iter_0000000").iterdir() if p.is_file())
    out_bytes = sum(p.stat().st_size for p in out.iterdir())
    print(f"checkpoint {ckpt_bytes / 1e9:.2f} GB; HF output {out_bytes / 1e9:.2f} GB "
          f"in {len(list(out.glob('*.safetensors')))} shards; work dir {work}")


if __name__ == "__main__":
    main()
