"""Build what the ranks build, for jobs the login node accepted: the differential test's rank side.

``python tests/_mcore_probe.py IN.pkl OUT.json``: IN holds a list of (case id, JobConfig). For each job, in this
one process: the exact Megatron-Core config objects (``models.builder.transformer_config``, DDP and optimizer
configs, LR scheduler arguments), then ``parallel_state.initialize_model_parallel`` with the job's real world
size on torch's *fake* process group (one process plays rank 0, then the last rank, of the real layout: every
group is created, collectives are no-ops), then that rank's build exactly as the rank entry does it
(``launcher.rank.training.build``: the backend checks, the model chunks, DDP, the (distributed)
optimizer, the LR scheduler and the model config's hooks; skipped for models too large for this machine). Jobs without
pipeline parallelism also run one forward and backward pass of the first microbatch on CPU. OUT gets {case id:
error or null}.

Hangs are detected on progress, by the caller: before each job the probe prints ``probe: case I/N: ID`` (flushed),
and the differential test stops a probe that has printed nothing for a generous while, naming the case it was on
(a fixed per-job time limit called a slow first compile on a busy machine a hang: issue 25). On CPU,
``model.cross_entropy_loss_fusion=true`` compiles the fused loss with Inductor (C++, through the machine's compiler;
cached in TORCHINDUCTOR_CACHE_DIR, by default /tmp/torchinductor_$USER): tens of CPU seconds the first time.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import pickle
import shutil
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_NUM_THREADS", "1")
warnings.filterwarnings("ignore")

import torch  # noqa: E402

MAX_BUILT_PARAMS = 40_000_000
MAX_BUILT_LAYERS = 64
"""Larger models stop after the config objects and the process groups (this machine cannot hold them)."""
MAX_STEP_TOKENS, MAX_STEP_PARAMS = 2048, 8_000_000
"""The forward/backward pass runs for one-process jobs up to this size (a few tens of ms each)."""
NO_CXX = shutil.which(os.environ.get("CXX", "g++")) is None
"""Inductor (the fused cross-entropy on CPU) needs a C++ compiler (its config.cpp.cxx: $CXX or g++). Without one,
a rank with model.cross_entropy_loss_fusion=true fails at its first forward with "InductorError:
InvalidCxxCompiler: No working C++ compiler found"; the probe then skips the step of such jobs (the caller says
how many) rather than report the machine as a Megatron-Core refusal."""


def _params(job) -> int:
    m = job.model
    experts = (m.num_experts or 1) * (m.moe_ffn_hidden_size or m.ffn_hidden_size)
    head = m.kv_channels or max(1, m.hidden_size // max(1, m.num_attention_heads))
    attention = 2 * m.hidden_size * head * (m.num_attention_heads + (m.num_query_groups or m.num_attention_heads))
    per_layer = attention + 3 * m.hidden_size * max(m.ffn_hidden_size, experts)
    return (m.num_layers + m.mtp_num_layers) * per_layer + 2 * m.vocab_size * m.hidden_size


def too_large(job) -> bool:
    return _params(job) > MAX_BUILT_PARAMS or job.model.num_layers + job.model.mtp_num_layers > MAX_BUILT_LAYERS


def build(job, rank: int) -> None:
    """Rank ``rank`` of the job's layout: process groups, model, DDP, optimizer (and a step when PP = 1)."""
    from megatron.core import parallel_state, tensor_parallel
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from launcher.core import derive
    from launcher.rank import optim, setup, training
    from models.builder import transformer_config

    lay, tr = derive(job), job.train
    # the config objects every rank constructs first
    transformer_config(model=job.model, parallel=job.parallel, precision=job.precision, layout=lay,
                       schedule=job.schedule, recompute=tr.recompute, recompute_num_layers=tr.recompute_num_layers,
                       recompute_modules=tr.recompute_modules, te=False,
                       activation_offload_modules=tr.activation_offload_modules,
                       activation_offload_fraction=tr.activation_offload_fraction,
                       min_offloaded_tensor_size=tr.min_offloaded_tensor_size)
    optim.ddp_config(parallel=job.parallel, precision=job.precision, on_gpu=False)
    optim.optimizer_config(train=tr, parallel=job.parallel, precision=job.precision, on_gpu=False)
    optim.scheduler_kwargs(train=tr, steps=lay.steps)
    torch.distributed.init_process_group("fake", rank=rank, world_size=lay.world, store=FakeStore())
    try:
        parallel_state.initialize_model_parallel(**setup.parallel_state_kwargs(lay))
        torch.manual_seed(tr.seed)
        tensor_parallel.model_parallel_cuda_manual_seed(tr.seed)
        if too_large(job):
            return
        model = training.build(job, lay, loop=False).model  # production's own build sequence
        if lay.pp == 1 and lay.world == 1 and job.model.seq_length * tr.micro_batch_size <= MAX_STEP_TOKENS \
                and _params(job) <= MAX_STEP_PARAMS and not (NO_CXX and job.model.cross_entropy_loss_fusion):
            _step(job, model[0])
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()
        _reset_trackers()


def _reset_trackers() -> None:
    """Megatron's process-global loss trackers are sized by the first model that logs into them (MTP layers,
    MoE layers); a rank builds one model, this process builds many."""
    from megatron.core.transformer.moe.moe_utils import get_moe_metrics_tracker
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    MTPLossLoggingHelper.tracker.clear()
    with contextlib.suppress(Exception):
        get_moe_metrics_tracker().metrics.clear()


def _step(job, chunk) -> None:
    """Forward and backward of one microbatch (one process: the fake group is the whole world)."""
    m, mbs = job.model, job.train.micro_batch_size
    tokens = torch.randint(0, m.vocab_size, (mbs, m.seq_length))
    pos = torch.arange(m.seq_length).expand(mbs, -1)
    loss = chunk(tokens, pos, None, labels=tokens.roll(-1, 1))
    loss.float().mean().backward()


def _fake_side_groups() -> None:
    """Megatron adds gloo side groups (CPU collectives of the distributed optimizer); on the fake world they
    become fake groups too."""
    new_group = torch.distributed.new_group

    def fake_new_group(*args, **kwargs):
        kwargs.pop("backend", None)
        return new_group(*args, **kwargs)

    torch.distributed.new_group = fake_new_group


def _recording(train, reads: dict):
    """A copy of the TrainConfig ``train`` that notes in ``reads`` each field read from it (its value); reading
    ``__dict__`` (copy, vars) counts as reading every field."""
    names = {f.name for f in dataclasses.fields(train)}

    class Recorded(type(train)):
        def __getattribute__(self, name):
            value = object.__getattribute__(self, name)
            if name in names:
                reads[name] = value
            elif name == "__dict__":
                reads.update(value)
            return value

    out = copy.copy(train)
    out.__class__ = Recorded
    return out


def _same(job, reads: dict) -> bool:
    return all(type(getattr(job.train, k)) is type(v) and getattr(job.train, k) == v for k, v in reads.items())


def main(argv: list[str]) -> int:
    from models import cpu_compat

    cpu_compat.apply()
    _fake_side_groups()
    cases = pickle.loads(Path(argv[0]).read_bytes())
    results = {}
    start = time.time()
    timings: list = []
    # jobs equal outside ``train`` -> [(the train fields that building one of them read, its result)]: a job that
    # agrees with such a one on every field it read builds exactly what it built (most train.* mutations: eval,
    # straggler, exit and NaN policies are the loop's, not Megatron-Core's), so that result is its own
    built: dict = {}
    reused = 0
    for index, (case_id, job) in enumerate(cases):
        from launcher.core import derive

        print(f"probe: case {index + 1}/{len(cases)}: {case_id}", flush=True)  # the caller's hang detector
        began = time.time()
        rest = repr([getattr(job, f.name) for f in dataclasses.fields(job) if f.name != "train"])
        done = next((error for reads, error in built.get(rest, []) if _same(job, reads)), False)
        if done is not False:
            results[case_id], reused = done, reused + 1
            continue
        reads: dict = {}
        job = copy.copy(job)
        job.train = _recording(job.train, reads)

        lay = derive(job)
        error = None
        for rank in dict.fromkeys([0, lay.world - 1]):
            try:
                build(job, rank)
            except BaseException as exc:  # noqa: BLE001 -- what the ranks would die of
                error = f"rank {rank}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:400]
                with contextlib.suppress(Exception):
                    from megatron.core import parallel_state
                    parallel_state.destroy_model_parallel()
                if torch.distributed.is_initialized():
                    torch.distributed.destroy_process_group()
            if error:
                break
        results[case_id] = error
        built.setdefault(rest, []).append((reads, error))
        timings.append((time.time() - began, case_id))
    results["__seconds__"] = round(time.time() - start, 2)
    results["__config_only__"] = sum(too_large(job) for _, job in cases)
    results["__reused__"] = reused
    results["__no_cxx_unstepped__"] = sum(bool(NO_CXX and job.model.cross_entropy_loss_fusion) for _, job in cases)
    results["__slowest__"] = [f"{t:.2f}s {c}" for t, c in sorted(timings, reverse=True)[:8]]
    Path(argv[1]).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
