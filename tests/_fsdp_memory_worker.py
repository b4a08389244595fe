"""Rank worker for tests/test_fsdp.py's memory check: build a job's model as the rank wing does
(launcher.rank.training.build: Megatron-FSDP and its distributed optimizer), take one training
step so every lazily made buffer exists, and report the bytes this rank holds in static state: each distinct tensor
storage reachable from Megatron-FSDP's buffers (sharded weights, fp32 main weights, sharded gradients), the model's
parameters (the unsharded ones outside the FSDP units, and the all-gathered layers) and the optimizer state,
counted once. ``torchrun ... _fsdp_memory_worker.py BUNDLE OUT``."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def _storages(tensors) -> dict:
    import torch

    out = {}
    for t in tensors:
        if not torch.is_tensor(t):
            continue
        t = getattr(t, "_local_tensor", t)
        st = t.untyped_storage()
        if st.nbytes():
            out[st.data_ptr()] = st.nbytes()
    return out


def measure(bundle: Path) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from launcher.core import derive, load_job
    from launcher.rank import loop, setup, training

    job = load_job(bundle / "config.yaml")
    layout = derive(job)
    setup.init_distributed(cluster=job.cluster, layout=layout, seed=job.train.seed)
    t = training.build(job, layout, loop=False)  # production's own build sequence; one step driven here
    model, opt = t.model, t.optimizer
    gen = torch.Generator().manual_seed(ps.get_data_parallel_rank())
    s, mbs, v = job.model.seq_length, job.train.micro_batch_size, job.model.vocab_size

    def batches():
        while True:
            t = torch.randint(0, v, (mbs, s + 1), generator=gen)
            yield {"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(mbs, s),
                   "position_ids": torch.arange(s).expand(mbs, s)}

    model[0].zero_grad_buffer()
    opt.zero_grad()
    loop.schedule_func("1f1b")(forward_step_func=loop.forward_step_for(micro_batch_size=mbs, seq_length=s),
                               data_iterator=batches(), model=model,
                               num_microbatches=1, seq_length=s, micro_batch_size=mbs, forward_only=False)
    opt.step()
    parts = {}
    for group in model[0].param_and_grad_buffer.parameter_groups:
        for kind in ("model_weight_buffer", "main_weight_buffer", "main_grad_buffer", "transpose_weight_buffer"):
            buf = getattr(group, kind)
            if buf is not None and buf.data is not None:
                parts.setdefault(kind, {}).update(_storages([buf.data]))
    # outside the FSDP units (TransformerLayer): embedding, output layer, final norm stay unsharded for good
    # (param_and_grad_buffer.py release_bucket: "Non-unit modules should remain persistently allocated")
    named = list(model[0].named_parameters())
    parts["root_weights"] = _storages(p for n, p in named if ".layers." not in n)
    parts["gathered_layers"] = _storages(p for n, p in named if ".layers." in n)  # all-gathered, released lazily
    parts["optimizer"] = _storages(v for st in opt.optimizer.state.values() for v in st.values())
    seen, sizes = {}, {}
    for kind, storages in parts.items():  # a storage counts once, under the first kind that holds it
        fresh = {k: b for k, b in storages.items() if k not in seen}
        seen.update(fresh)
        sizes[kind] = sum(fresh.values())
    return {"rank": torch.distributed.get_rank(), "bytes": sizes, "total": sum(seen.values())}


def main(bundle: str, out: str) -> None:
    import torch

    result = measure(Path(bundle))
    Path(out, f"rank{result['rank']}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
