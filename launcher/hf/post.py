"""``python -m launcher post RUN`` (a bundle path, or a bundle or job name under runs/, as ``status`` takes): the steps after training (``post.*``), for every kept checkpoint of the run.

- ``post.export_hf``: ``<checkpoint>/hf`` through export-hf (launcher/hf/export.py), once per checkpoint.
- ``post.eval``: the perplexity of the exported model (transformers, CPU is enough) on held-out tokens, written
  atomically to ``<checkpoint>/eval.json``: ``{"iteration", "tokens", "loss", "perplexity", "blend"}``. The held-out
  tokens are ``post.eval_blend`` read whole, else the validation split (``data.split``) of ``data.blend``: the
  documents Megatron-Core's dataset builder gives the validation split, so the score is measured on text training
  never read. Why the exported model and not the ranks in an eval-only mode: one process on any node, no
  rendezvous and no layout, and it checks the export on the way (test_hf shows its logits equal the launcher's).
- ``post.lm_eval_tasks``: lm-eval-harness on the export where ``lm_eval`` is installed; else said once, skipped.

The chain's state goes to ``BUNDLE/post.json`` (running, done, failed and why; each checkpoint's results), which
``runs`` and ``status`` read (launcher/run_state.py). Started by the bundle's post.sh: by the Slurm training job at
its successful end (post.sbatch, ``afterok`` on itself), or by ``action=run`` after training.
"""
from __future__ import annotations

import json
import math
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from launcher.core.blend import parse_blend
from launcher.core.checkpoint.directory import checkpoint_dir, complete_checkpoints

USAGE = "python -m launcher post RUN"
STATE_FILE = "post.json"
EVAL_FILE = "eval.json"
BATCH = 4
"""Sequences per forward pass: small enough for any node's CPU memory with a real model's vocabulary."""


class PostError(Exception):
    """A post step that cannot be done: one line."""


def atomic_json(path: Path, data) -> None:
    """Write JSON by a temporary sibling renamed over the target (a reader never sees half a file)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---- held-out tokens -------------------------------------------------------------------------------------------

def split_bounds(split: str) -> tuple[float, float]:
    """The validation split's [begin, end) as fractions of a dataset's documents, by Megatron-Core's own functions:
    its builder gives split i the documents round(lo_i * N) .. round(hi_i * N)
    (``BlendedMegatronDatasetBuilder._build_megatron_dataset_splits``), so these are the documents the ranks'
    validation reads and training never does."""
    from megatron.core.datasets.blended_megatron_dataset_config import (convert_split_vector_to_split_matrix,
                                                                        parse_and_normalize_split)

    bounds = convert_split_vector_to_split_matrix(parse_and_normalize_split(str(split)))[1]
    if bounds is None or bounds[1] <= bounds[0]:
        raise PostError(f"data.split={split} gives the validation split no documents; set post.eval_blend")
    return float(bounds[0]), float(bounds[1])


def held_out_samples(prefixes: list[tuple[float, str]], *, whole: bool, split: str, seq_length: int,
                     samples: int):
    """Up to ``samples`` sequences of ``seq_length + 1`` tokens (inputs and their next tokens), each dataset's share
    by its blend weight, read in document order from its held-out documents. A (n, seq_length + 1) int64 tensor."""
    import numpy as np
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    total_w = sum(w for w, _ in prefixes)
    rows = []
    for weight, prefix in prefixes:
        want = max(1, round(samples * weight / total_w))
        ds = IndexedDataset(prefix)
        docs = ds.document_indices  # sequence index where each document starts (+ the end)
        n_docs = len(docs) - 1
        bounds = (0.0, 1.0) if whole else split_bounds(split)
        lo, hi = int(round(bounds[0] * float(n_docs))), int(round(bounds[1] * float(n_docs)))
        need, chunks, have = want * seq_length + 1, [], 0
        for seq in range(int(docs[lo]), int(docs[hi])):
            if have >= need:
                break
            chunks.append(np.asarray(ds[seq], dtype=np.int64))
            have += len(chunks[-1])
        stream = np.concatenate(chunks) if chunks else np.zeros(0, np.int64)
        n = min(want, (len(stream) - 1) // seq_length) if len(stream) > seq_length else 0
        rows += [stream[i * seq_length: (i + 1) * seq_length + 1] for i in range(n)]
    if not rows:
        where = "post.eval_blend" if whole else f"the validation split (data.split={split}) of data.blend"
        raise PostError(f"{where} holds fewer than {seq_length + 1} tokens: nothing to evaluate; give a larger "
                        "post.eval_blend")
    return torch.from_numpy(np.stack(rows))


def perplexity(hf_dir: Path, samples) -> tuple[float, int]:
    """(mean next-token cross-entropy in nats, tokens scored) of the HF model in ``hf_dir`` on ``samples``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32)
    model.eval()
    loss_sum, count = 0.0, 0
    with torch.no_grad():
        for batch in samples.split(BATCH):
            logits = model(input_ids=batch[:, :-1]).logits.float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                                     reduction="sum")
            loss_sum += float(loss)
            count += batch[:, 1:].numel()
    return loss_sum / count, count


# ---- the chain ---------------------------------------------------------------------------------------------------

class Chain:
    """The post steps of one bundle, its state kept in BUNDLE/post.json after every change."""

    def __init__(self, bundle: Path, log=print):
        from launcher.core import load_job

        self.bundle, self.log = bundle, log
        self.job = load_job(bundle / "config.yaml")
        self.state = {"state": "running", "steps": self.steps(), "host": socket.gethostname(), "pid": os.getpid(),
                      "job_id": os.environ.get("SLURM_JOB_ID"), "started": time.time(), "checkpoints": [],
                      "reason": None, "notes": []}

    def steps(self) -> list[str]:
        p = self.job.post
        return [name for name, on in (("export_hf", p.export_hf), ("eval", p.eval),
                                      ("lm_eval", bool(p.lm_eval_tasks))) if on]

    def save(self) -> None:
        atomic_json(self.bundle / STATE_FILE, self.state)

    def blend(self) -> tuple[list, bool]:
        """(weighted prefixes, read whole?): post.eval_blend whole, else data.blend's validation split."""
        post, data = self.job.post, self.job.data
        if post.eval_blend:
            return parse_blend(list(post.eval_blend)), True
        if data.kind != "indexed":
            raise PostError(f"post.eval=true: data.kind={data.kind} has no validation split; set post.eval_blend")
        return parse_blend(list(data.blend)), False

    def run(self) -> int:
        self.save()
        try:
            ckpts = sorted(complete_checkpoints(checkpoint_dir(self.job.checkpoint.dir, self.bundle)),
                           key=lambda pm: int(pm[1]["step"]))
            if not ckpts:
                raise PostError(f"no complete checkpoint in {checkpoint_dir(self.job.checkpoint.dir, self.bundle)}: "
                                "nothing to export or evaluate (checkpoint.save_at_end=true keeps the last step)")
            samples = self.held_out() if self.job.post.eval else None
            for path, manifest in ckpts:
                self.state["checkpoints"].append(self.one(path, int(manifest["step"]), samples))
                self.save()
        except PostError as exc:
            return self.end("failed", str(exc))
        except Exception as exc:  # noqa: BLE001 - the chain's state says why in one line; the traceback goes to the log
            import traceback

            traceback.print_exc()
            return self.end("failed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        return self.end("done", None)

    def end(self, state: str, reason: Optional[str]) -> int:
        self.state.update(state=state, reason=reason, ended=time.time())
        self.save()
        self.log(f"post: {state}" + (f": {reason}" if reason else f" ({len(self.state['checkpoints'])} checkpoint(s))"))
        return 0 if state == "done" else 1

    def held_out(self):
        prefixes, whole = self.blend()
        model = self.job.model
        return held_out_samples(prefixes, whole=whole, split=self.job.data.split, seq_length=model.seq_length,
                                samples=self.job.post.eval_samples)

    def one(self, ckpt: Path, step: int, samples) -> dict:
        """Export, evaluate and run lm-eval on one checkpoint; what it left there."""
        post, done = self.job.post, {"iteration": step, "path": str(ckpt)}
        hf = ckpt / "hf"
        scratch = None
        if post.export_hf or post.eval or post.lm_eval_tasks:
            if not post.export_hf and not (hf / "config.json").is_file():  # a temporary export for eval only
                scratch = Path(tempfile.mkdtemp(prefix=".post-hf.", dir=ckpt))
                hf = scratch / "hf"
            if not (hf / "config.json").is_file():
                from launcher.hf.export import ExportError, export

                try:
                    export(ckpt, hf, config=self.bundle / "config.yaml", log=self.log)
                except ExportError as exc:
                    raise PostError(str(exc)) from None
        try:
            if post.export_hf:
                done["hf"] = str(hf)
            if post.eval:
                done["eval"] = self.evaluate(ckpt, step, hf, samples)
            if post.lm_eval_tasks:
                done["lm_eval"] = self.lm_eval(ckpt, hf)
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        return done

    def evaluate(self, ckpt: Path, step: int, hf: Path, samples) -> dict:
        loss, tokens = perplexity(hf, samples)
        prefixes, whole = self.blend()
        result = {"iteration": step, "tokens": tokens, "loss": round(loss, 6),
                  "perplexity": round(math.exp(min(loss, 700.0)), 4),
                  "blend": [p for _, p in prefixes] if whole else f"validation split ({self.job.data.split}) of "
                  + ", ".join(p for _, p in prefixes)}
        atomic_json(ckpt / EVAL_FILE, result)
        self.log(f"post: eval {ckpt.name}: loss {loss:.4f}, perplexity {result['perplexity']:.2f} on {tokens} tokens")
        return result

    def lm_eval(self, ckpt: Path, hf: Path) -> str:
        """lm-eval-harness's tasks on the export, where lm_eval is installed; said once and skipped otherwise."""
        tasks = list(self.job.post.lm_eval_tasks)
        try:
            import lm_eval
        except ImportError:
            note = f"lm-eval-harness (lm_eval) is not installed: post.lm_eval_tasks={tasks} skipped"
            if note not in self.state["notes"]:
                self.state["notes"].append(note)
                self.log(f"post: {note}")
            return "skipped: lm_eval not installed"
        out = lm_eval.simple_evaluate(model="hf", model_args=f"pretrained={hf},dtype=float32", tasks=tasks,
                                      device="cpu", batch_size=1)
        atomic_json(ckpt / "lm_eval.json", {"iteration": int(ckpt.name.split("_")[-1]),
                                             "results": out.get("results", {})})
        return str(ckpt / "lm_eval.json")


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        if argv[:1] in (["-h"], ["--help"]):
            print(f"usage: {USAGE}\n\n{__doc__.splitlines()[0]}")
            return 0
        print(f"error: post takes one RUN (a run bundle path or a name under runs/), got {' '.join(argv) or 'nothing'}: "
              f"{USAGE}", file=sys.stderr)
        return 2
    from launcher.runs import UsageError, resolve  # the login commands' RUN, so status and post name runs alike

    try:
        bundle = resolve(argv[0])
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return Chain(bundle, log=lambda line: print(line, flush=True)).run()
