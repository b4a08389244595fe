"""torchrun worker for tests/test_combined_1f1b.py: one training step of a tiny MoE GPT with expert parallelism
under Megatron-Core's plain 1F1B (no pipelining) schedule and under its combined 1F1B schedule
(``overlap_moe_expert_parallel_comm``: ``combined_1f1b_schedule_for_no_pipelining``, which calls our
``loop.forward_step(..., return_schedule_plan=True)`` and runs the returned schedule plan layer by layer), on the
same weights and data, in the same processes.

Usage: torchrun --nproc_per_node=N tests/_combined_1f1b_worker.py OUT_DIR override [override ...]
Writes OUT_DIR/rank-<r>.json:
- ``stops_at``: where the combined schedule stops on CPU torch as shipped (file:line and the error), i.e. with only
  models/cpu_compat.py applied;
- the per-microbatch losses and, per parameter, max |grad difference| and max |grad| of the two schedules, the
  combined one run with the test-only stream bridge below.

The test-only stream bridge (``cpu_streams``) is what the combined schedule needs beyond models/cpu_compat.py on
CPU torch, and nothing else: the ``torch`` name of the six schedule-plan modules answers ``torch.cuda.Stream /
Event / stream / current_stream`` with cpu_compat's no-op stand-ins, and ``Tensor.record_stream`` (the caching
allocator's cross-stream hint, meaningless for CPU memory) ignores a stand-in stream. It is not product code: the
validator refuses parallel.moe_a2a_overlap without Transformer Engine, i.e. on CPU.
"""
from __future__ import annotations

import contextlib
import json
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SCHEDULE_PLAN_MODULES = (
    "megatron.core.pipeline_parallel.utils",  # set_streams: torch.cuda.Stream; ScheduleNode: stream/event
    "megatron.core.pipeline_parallel.combined_1f1b",  # torch.cuda.current_stream in _release_tensor_storage
    "megatron.core.models.common.model_chunk_schedule_plan",  # torch.cuda.Event(), current_stream, stream
    "megatron.core.models.common.utils",  # TransformerLayerNode: torch.cuda.stream
    "megatron.core.models.common.fine_grained_callables",
    "megatron.core.models.gpt.fine_grained_callables",  # residual.record_stream(torch.cuda.current_stream())
)


@contextlib.contextmanager
def cpu_streams():
    """The test-only stream bridge (module docstring); undone on exit."""
    import importlib

    import torch

    from models import cpu_compat

    modules = [importlib.import_module(name) for name in SCHEDULE_PLAN_MODULES]
    saved = [m.torch for m in modules]
    record_stream = torch.Tensor.record_stream

    def record_stream_on_cpu(self, stream):
        if isinstance(stream, cpu_compat._NullStream):
            return None
        return record_stream(self, stream)

    for m in modules:
        m.torch = cpu_compat.TORCH_ON_CPU
    torch.Tensor.record_stream = record_stream_on_cpu
    try:
        yield
    finally:
        torch.Tensor.record_stream = record_stream
        for m, t in zip(modules, saved):
            m.torch = t


def one_step(job, layout, bundle: Path, combined: bool):
    """Fresh model (same seed) in Megatron DDP; one forward-backward; its per-microbatch losses and grads."""
    import torch

    from launcher.rank import loop, training

    t = training.build(job, layout, loop=False)  # production's own build sequence; one step driven here
    model = t.model
    # fp32 on CPU (exact comparison); TransformerConfig's bf16/fp16 assert for the overlap is a GPU numerics rule,
    # so the flag is set on the built config (the chunk's, which its DDP wrapper shares; DDP, the optimizer and
    # the config hooks do not read it), which every layer and the schedule read at run time
    model[0].config.overlap_moe_expert_parallel_comm = combined
    iters, _ = t.iterators(cache_dir=str(bundle / "cache"))
    for chunk in model:
        chunk.zero_grad_buffer()
    forward = loop.forward_step_for(micro_batch_size=job.train.micro_batch_size, seq_length=job.model.seq_length)
    losses = loop.schedule_func("1f1b")(forward_step_func=forward, data_iterator=iters[0], model=model,
                                        num_microbatches=layout.microbatches, seq_length=job.model.seq_length,
                                        micro_batch_size=job.train.micro_batch_size, forward_only=False)
    grads = {name: p.main_grad.detach().clone() for name, p in model[0].named_parameters()}
    return [float(x["lm loss"]) for x in losses], grads


def where_it_stops(job, layout, bundle: Path) -> dict:
    """Run the combined schedule with only models/cpu_compat.py: the innermost Megatron/torch frame that raises."""
    try:
        one_step(job, layout, bundle, combined=True)
    except Exception as exc:  # noqa: BLE001 - the point is to report which line stops it
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if "megatron/core" in f.filename]
        last = frames[-1]
        return {"file": last.filename.split("site-packages/")[-1], "line": last.lineno, "code": last.line,
                "error": f"{type(exc).__name__}: {exc}"}
    return {}


def main() -> int:
    out, overrides = Path(sys.argv[1]), sys.argv[2:]
    import torch

    from launcher.config import compose_job
    from launcher.core import derive
    from launcher.rank import setup

    job = compose_job(overrides)
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    rank = torch.distributed.get_rank()
    stops_at = where_it_stops(job, layout, out)
    torch.distributed.barrier()
    ref_losses, ref_grads = one_step(job, layout, out, combined=False)
    with cpu_streams():
        cb_losses, cb_grads = one_step(job, layout, out, combined=True)
    assert ref_grads.keys() == cb_grads.keys()
    report = {
        "stops_at": stops_at, "losses_1f1b": ref_losses, "losses_combined": cb_losses,
        "grads": {name: {"max_abs_diff": float((cb_grads[name] - g).abs().max()), "max_abs": float(g.abs().max())}
                  for name, g in ref_grads.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))
    setup.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
