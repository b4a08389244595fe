"""The p2p issue order of every schedule the ranks execute, for any PP, recorded in one process (test support).

A pipeline schedule's sends and receives depend only on the stage index, the stage count, the microbatch
count and the schedule's config, not on the peer's data. So this driver runs the *real* schedule code —
Megatron-Core's ``forward_backward_pipelining_without_interleaving`` (1F1B) and
``..._with_interleaving`` (interleaved), and our ``forward_backward_zb_h1`` (over one chunk or a virtual
pipeline) and ``forward_backward_zb_v`` — once as each stage ``r`` of ``p``,
in this one process, on a tiny stand-in stage module, with torch.distributed's p2p calls recorded instead of
sent (receives are filled with zeros; tests/_nccl_emulation.py ``fake_ranks``). The schedule's p2p config
(``batch_p2p_comm``, ``overlap_p2p_comm``, microbatch groups) comes from our own builder for the composed job.
tests/test_nccl_semantics.py checks these traces against real multi-process runs (same events), then replays
them under NCCL's rules for PP 2..16.

Usage: python tests/_p2p_fake_rank.py OUT.json KIND:P:M:V [KIND:P:M:V ...]
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

HIDDEN, SEQ, MBS = 8, 4, 2


class FakeGroup:
    """The pipeline group as seen by stage ``r`` of ``p`` (only what the schedules ask of it)."""

    def __init__(self, r: int, p: int):
        self._r, self._p = r, p

    def rank(self) -> int:
        return self._r

    def size(self) -> int:
        return self._p


class FakeUpGroup(FakeGroup):
    """The second pipeline channel (messages to the lower rank) of a program over several chunks."""


def _stage_class():
    import torch
    from megatron.core.transformer.enums import ModelType

    class Stage(torch.nn.Module):
        """One model chunk: a linear layer on the received activation (or on a zero batch on the first stage)."""

        model_type = ModelType.encoder_or_decoder

        def __init__(self, config, pre: bool, post: bool, vp_stage):
            super().__init__()
            self.config, self.pre, self.post, self.vp_stage = config, pre, post, vp_stage
            self.linear = torch.nn.Linear(HIDDEN, HIDDEN)
            self.input_tensor = None

        def set_input_tensor(self, tensor):
            self.input_tensor = tensor[0] if isinstance(tensor, list) else tensor

        def forward(self, batch):
            return self.linear(batch if self.pre else self.input_tensor) + 0  # not a view: Megatron frees it

    return Stage


def forward_step(data_iterator, model):
    import torch

    batch = torch.zeros(SEQ, MBS, HIDDEN, device="cpu") if model.pre else None

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"lm loss": loss.detach()}

    return model(batch), loss_func


def job_config(kind: str, p: int, m: int, v: int):
    """Our builder's p2p fields for the composed job (schedule kind, PP p, VPP v, m microbatches)."""
    from _rank_harness import TINY
    from launcher.config import compose_job
    from launcher.core import derive
    from models.builder import _schedule_fields

    overrides = [*TINY, f"model.num_layers={p * v}", f"parallel.pipeline={p}", f"cluster.gpus_per_node={p}",
                 f"train.global_batch_size={m * 2}", f"schedule.kind={kind}"]
    if v > 1:
        overrides.append(f"parallel.virtual_pipeline={v}")
    job = compose_job(overrides)
    layout = derive(job)
    return layout, _schedule_fields(layout, job.schedule)


def record(kind: str, p: int, m: int, v: int) -> list:
    """Per stage, the events it issues in one training step of ``kind``."""
    import torch
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.pipeline_parallel import schedules as S
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.process_groups_config import ProcessGroupCollection

    import _nccl_emulation as emu
    from launcher.core.pipeline.schedules import stage_of
    from launcher.rank import zb_executor as zero_bubble
    from launcher.rank.zb_executor import forward_backward_zb_h1, forward_backward_zb_v

    layout, fields = job_config(kind, p, m, v)
    Stage = _stage_class()
    traces = []
    for r in range(p):
        group = FakeGroup(r, p)
        world = torch.distributed.group.WORLD
        emu.fake_ranks(channel=lambda g: "pp_up" if isinstance(g, FakeUpGroup) else "pp" if isinstance(g, FakeGroup)
                       else "world" if g in (None, world) else "other", recv=lambda t: t.data.zero_())
        zero_bubble.up_group = lambda pp_group: FakeUpGroup(pp_group.rank(), pp_group.size())
        config = ModelParallelConfig(pipeline_model_parallel_size=p, pipeline_dtype=torch.float32,
                                     virtual_pipeline_model_parallel_size=v if v > 1 else None,
                                     deallocate_pipeline_outputs=True, **fields)
        config.hidden_size = HIDDEN  # get_tensor_shapes reads it (a TransformerConfig field)
        config.finalize_model_grads_func = None  # gradient sync is not p2p (and its groups are not faked)
        comm = P2PCommunicator.__new__(P2PCommunicator)
        comm.pp_group, comm.config = group, config
        comm.next_rank, comm.prev_rank = (r + 1) % p, (r - 1) % p
        comm.virtual_pipeline_model_parallel_size = config.virtual_pipeline_model_parallel_size
        pg = ProcessGroupCollection()
        base = S._build_default_pg_collection()
        pg.tp, pg.cp, pg.pp, pg.embd, pg.pos_embd = base.tp, base.cp, group, None, None
        pg.dp, pg.dp_cp, pg.tp_dp_cp = base.dp, base.dp_cp, base.tp_dp_cp
        last = p * v - 1
        chunks = [Stage(config, pre=stage_of(kind, p, r, c) == 0, post=stage_of(kind, p, r, c) == last, vp_stage=c)
                  for c in range(v)]
        for chunk in chunks:
            chunk.config = config
        kwargs = dict(forward_step_func=forward_step, data_iterator=[iter(()) for _ in chunks], model=chunks,
                      num_microbatches=m, seq_length=SEQ, micro_batch_size=MBS, forward_only=False,
                      p2p_communicator=comm, pg_collection=pg)
        if kind == "zb_h1":
            forward_backward_zb_h1(**kwargs)
        elif kind == "zb_v":
            forward_backward_zb_v(**kwargs)
        elif v > 1:
            S.forward_backward_pipelining_with_interleaving(**kwargs)
        else:
            S.forward_backward_pipelining_without_interleaving(**kwargs)
        traces.append(_renumber(emu.take_events(), r))
    return traces


def _renumber(events: list, r: int) -> list:
    """Item ids as (rank, n) in post order: what launcher.core.pipeline.p2p.replay keys items by."""
    ids, out = {}, []
    for ev in events:
        if ev[0] == "post":
            ids[ev[1]] = [r, len(ids)]
            out.append(["post", ids[ev[1]], [list(op) for op in ev[2]], ev[3]])
        elif ev[0] == "wait":
            out.append(["wait", ids[ev[1]]])
    return out


def main() -> int:
    out, specs = Path(sys.argv[1]), sys.argv[2:]
    import torch

    import _nccl_emulation as emu
    from models import cpu_compat

    emu.install()
    cpu_compat.apply()
    from _rendezvous import init_single

    init_single()
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel()
    result = {}
    for spec in specs:
        kind, p, m, v = spec.split(":")
        result[spec] = record(kind, int(p), int(m), int(v))
    out.write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
