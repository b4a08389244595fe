"""ZB-H1 (Qi et al., ICLR 2024) on Megatron-Core: the pipeline executor, and the executed-timeline recorder.

Megatron-Core has no zero-bubble schedule, so this module runs one with Megatron's own pieces: its
``forward_step`` / ``backward_step`` (loss scaling, CP factor, MoE/MTP loss hooks, input-grad retention),
its ``P2PCommunicator`` for every pipeline send/recv, and its ``finalize_model_grads`` at the end. The op
order is ``launcher.core.pipeline.schedules.schedule_zb_h1`` — the list the planner simulates — executed literally:

* F: forward on the received activation; its output is sent to the next stage;
* B: backward on the received output gradient, with the weight-gradient GEMMs of the parallel linear layers
  deferred (``models/deferred_wgrad.py``); the input gradient is sent upstream at once;
* W: run one microbatch's deferred weight-gradient GEMMs (oldest first), accumulating into DDP's
  ``main_grad`` buffers.

The sends and receives around them are the p2p program ``launcher.core.pipeline.p2p.plan`` derives from the op list,
executed literally. Over one chunk each group is posted as one ``batch_isend_irecv``, a send fused with the next
receive from the same peer (Megatron's ``send_forward_recv_backward`` rule, so two stages never both wait on a lone
send under NCCL's blocking sends). Over several chunks (ZB-V, ZB-H1 over a virtual pipeline) every rank posts
single sends and receives in one global order of the messages, so the program also completes where a GPU runs all
its kernels on one hardware queue (``CUDA_DEVICE_MAX_CONNECTIONS=1``). Each receive is waited right before the op
that needs it. ``tests/test_nccl_semantics.py`` replays the program, and the order the ranks really issue, under
NCCL's rules (one queue per communicator, and one per GPU) for PP 2..16.

Gradient reduction: a parameter's gradient is complete only after its last W. Without ``overlap_grad_reduce``
the DP reduce (and the embedding/SP all-reduces) run once, in ``finalize_model_grads`` after the last W, as
with 1F1B. With it, Megatron DDP's hook of a deferred weight runs in its W (``models/deferred_wgrad.py``), so in
the last microbatch a bucket's reduce starts as soon as the last W of its weights has run (``_grad_sync``);
``finalize_model_grads`` waits for them. The optimizer, clipping and the grad norm see 1F1B's gradients.
"""
from __future__ import annotations

import collections
import contextlib
import copy
import re
import time
from functools import partial
from typing import Callable, List, Optional

import torch

from launcher.core.pipeline import p2p
from launcher.core.pipeline.schedules import schedule_1f1b, schedule_zb_h1, schedule_zb_v
from launcher.schema import Schedule
from models.backend import compute_device


class _Stamp(float):
    """A ``time.perf_counter()`` stamp that also carries ``time.thread_time()`` (``.cpu``), taken together."""

    def __new__(cls, wall: float, cpu: float):
        stamp = super().__new__(cls, wall)
        stamp.cpu = cpu
        return stamp


class Recorder:
    """Spans of what this rank ran in the current step (opt-in: ``schedule.record_timeline``): seconds from the
    step's start; the step starts after a barrier so ranks share an origin.

    On CPU a span's ends are ``time.perf_counter()`` stamps. On a GPU the host clock would time kernel
    *launches*, not their execution, so each end is a CUDA event recorded on the current stream instead, and the
    events are turned into seconds once per step (one synchronize when the step's spans are first read, not one
    per op: that is what keeps the recorder cheap)."""

    KEEP = 16
    """Steps kept (the newest); the drawing shows the last one, spans.json holds all kept."""

    def __init__(self, event_factory: Optional[Callable] = None) -> None:
        if event_factory is None and torch.cuda.is_available():
            event_factory = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
        self._event = event_factory
        self._raw: List[tuple] = []
        self._resolved: Optional[List[tuple]] = []
        self._history: "collections.deque[list]" = collections.deque(maxlen=self.KEEP)
        self._origin = self.now()

    def now(self):
        """A time stamp: a float on CPU (carrying this thread's CPU time, ``_Stamp``), a recorded CUDA event on
        GPU."""
        if self._event is None:
            return _Stamp(time.perf_counter(), time.thread_time())
        ev = self._event()
        ev.record()
        return ev

    def add(self, kind: str, microbatch: int, chunk: int, start, end) -> None:
        """One executed op between two stamps of :meth:`now`."""
        self._raw.append((kind, microbatch, chunk, start, end))
        self._resolved = None

    def start_step(self) -> None:
        if torch.distributed.is_initialized():
            torch.distributed.barrier()
        self._raw, self._resolved = [], []
        self._origin = self.now()
        self._history.append((self._origin, self._raw))

    def _seconds(self, origin, stamp) -> float:
        return stamp - origin if self._event is None else origin.elapsed_time(stamp) / 1e3

    def _resolve(self, origin, raw: List[tuple]) -> List[tuple]:
        if self._event is not None and raw:
            raw[-1][4].synchronize()  # the step's last event: every earlier one on this stream has completed
        return [(k, mb, c, self._seconds(origin, s), self._seconds(origin, e)) for k, mb, c, s, e in raw]

    @property
    def spans(self) -> List[tuple]:
        """This step's spans as (kind, microbatch, chunk, start s, end s)."""
        if self._resolved is None:
            self._resolved = self._resolve(self._origin, self._raw)
        return self._resolved

    @property
    def history(self) -> List[List[tuple]]:
        """The last ``KEEP`` steps' spans, oldest first."""
        return [self.spans if raw is self._raw else self._resolve(origin, raw) for origin, raw in self._history]

    @property
    def cpu_seconds(self) -> Optional[List[float]]:
        """This step's spans' CPU time on the recording thread (None on GPU): with ranks sharing cores, a span's
        wall time includes the time its rank was descheduled, its CPU time does not (benchmarks replay these
        through the executed order: ``launcher.plan.simulator.replay``)."""
        if self._event is not None:
            return None
        return [e.cpu - s.cpu for _, _, _, s, e in self._raw]

    @property
    def cpu_history(self) -> Optional[List[List[float]]]:
        """:attr:`cpu_seconds` of each of the last ``KEEP`` steps' spans, in :attr:`history`'s order (None on GPU):
        what action=bench fits per-op costs to on CPU, where a span's wall time depends on how many ranks shared
        the cores meanwhile."""
        if self._event is not None:
            return None
        return [[e.cpu - s.cpu for _, _, _, s, e in raw] for _, raw in self._history]

    @contextlib.contextmanager
    def span(self, kind: str, microbatch: int, chunk: int = 0):
        start = self.now()
        try:
            yield
        finally:
            self.add(kind, microbatch, chunk, start, self.now())


def _span(recorder: Optional[Recorder], kind: str, mb: int, chunk: int = 0):
    return recorder.span(kind, mb, chunk) if recorder is not None else contextlib.nullcontext()


def forward_backward_zb_h1(*, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                           micro_batch_size: int, decoder_seq_length: Optional[int] = None,
                           forward_only: bool = False, collect_non_loss_data: bool = False,
                           first_val_step: Optional[bool] = None, recorder: Optional[Recorder] = None,
                           order: Optional[Callable] = None, p2p_communicator=None, pg_collection=None):
    """Megatron's forward_backward_func interface, running the ZB-H1 order; with a list of several model chunks
    (a virtual pipeline, placed as Megatron's interleaved schedule places them) the same rule over Megatron's
    interleaved order (``schedule_zb_h1(p, m, v, group)``). ``forward_only`` (evaluation) runs Megatron's own
    function for the placement: forwards are the same in both schedules. ``order(p, m)`` is exchangeable for
    tests (``schedule_1f1b`` runs 1F1B's order through this executor). ``p2p_communicator`` and
    ``pg_collection`` as in Megatron-Core's schedules (default: from parallel_state)."""
    from megatron.core.pipeline_parallel import schedules as S
    from megatron.core.utils import get_model_config

    chunks = len(model) if isinstance(model, list) else 1
    if forward_only:
        run = (S.forward_backward_pipelining_with_interleaving if chunks > 1
               else S.forward_backward_pipelining_without_interleaving)
        return run(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                   num_microbatches=num_microbatches, seq_length=seq_length, micro_batch_size=micro_batch_size,
                   decoder_seq_length=decoder_seq_length, forward_only=True,
                   collect_non_loss_data=collect_non_loss_data, first_val_step=first_val_step,
                   p2p_communicator=p2p_communicator, pg_collection=pg_collection)
    if order is None:
        if chunks > 1:  # Megatron's interleaved grouping (microbatch_group_size_per_vp_stage, default PP)
            group = getattr(get_model_config(model[0]), "microbatch_group_size_per_vp_stage", None)
            order = partial(schedule_zb_h1, v=chunks, group=group)
        else:
            order = schedule_zb_h1
    return _run(Schedule.INTERLEAVED if chunks > 1 else Schedule.ONE_F_ONE_B, order, forward_step_func,
                data_iterator, model, num_microbatches, seq_length, micro_batch_size, decoder_seq_length, False,
                collect_non_loss_data, first_val_step, recorder, p2p_communicator, pg_collection)


def forward_backward_zb_v(*, forward_step_func, data_iterator, model, num_microbatches: int, seq_length: int,
                          micro_batch_size: int, decoder_seq_length: Optional[int] = None,
                          forward_only: bool = False, collect_non_loss_data: bool = False,
                          first_val_step: Optional[bool] = None, recorder: Optional[Recorder] = None,
                          p2p_communicator=None, pg_collection=None, costs: tuple = (1.0, 1.0, 1.0)):
    """The same interface, running ZB-V (``launcher.core.pipeline.schedules.schedule_zb_v`` for chunk ``costs``,
    schedule.zb_v_costs) over this rank's two model chunks (chunk 0: stage r, chunk 1: stage 2p - 1 - r;
    ``models.builder`` builds them so). ``forward_only`` runs the F ops of the same order under no_grad
    (Megatron has no schedule for a V)."""
    return _run(Schedule.ZB_V, partial(schedule_zb_v, costs=costs), forward_step_func, data_iterator, model,
                num_microbatches, seq_length, micro_batch_size, decoder_seq_length, forward_only,
                collect_non_loss_data, first_val_step, recorder, p2p_communicator, pg_collection)


_UP_GROUPS: dict = {}
"""ZB-V's second pipeline channel (messages to the lower rank): pipeline group ranks -> process group."""


def up_group(pp_group):
    """A second process group over the pipeline group's ranks (``launcher.core.pipeline.p2p.UP``), created once, by every
    rank of the world for every pipeline group in the same order (new_group is collective)."""
    ranks = tuple(torch.distributed.get_process_group_ranks(pp_group))
    if ranks not in _UP_GROUPS:
        everyone = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(everyone, ranks)
        for group_ranks in sorted(set(everyone)):
            group = torch.distributed.new_group(list(group_ranks))
            _UP_GROUPS.setdefault(group_ranks, group)
    return _UP_GROUPS[ranks]


def _run(placement: str, order: Callable, forward_step_func, data_iterator, model, num_microbatches: int,
         seq_length: int, micro_batch_size: int, decoder_seq_length, forward_only: bool, collect_non_loss_data: bool,
         first_val_step, recorder, p2p_communicator, pg_collection):
    """Execute ``order``'s op list for this rank literally, with the p2p program ``launcher.core.pipeline.p2p.plan``
    derives from it (``placement``: how chunks map to stages)."""
    from megatron.core import parallel_state
    from megatron.core.pipeline_parallel import schedules as S
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.utils import get_model_config

    from launcher.core.pipeline.schedules import place, stage_of
    from models.deferred_wgrad import STORE, te_modules

    models = list(model) if isinstance(model, list) else [model]
    iters = list(data_iterator) if isinstance(data_iterator, list) else [data_iterator]
    chunks = len(models)
    config = get_model_config(models[0])
    pg = pg_collection or S._build_default_pg_collection()
    comm = p2p_communicator or P2PCommunicator(pp_group=parallel_state.get_pipeline_model_parallel_group(),
                                               config=config)
    shape = S.get_tensor_shapes(seq_length=seq_length, micro_batch_size=micro_batch_size,
                                decoder_seq_length=decoder_seq_length, config=config, tp_group=pg.tp,
                                cp_group=pg.cp)[0]
    rank, p = comm.current_stage, comm.total_stages
    schedule = order(p, num_microbatches)
    if forward_only:  # evaluation: the F ops of the same order (a valid order of the forwards alone)
        schedule = [[op for op in ops if op.kind == "F"] for ops in schedule]
    # overlap_p2p_comm: over several chunks each receive is posted one op early (launcher.core.pipeline.p2p.plan)
    program = p2p.plan(schedule[rank], rank, p, placement=placement, schedule=schedule,
                       overlap=bool(getattr(config, "overlap_p2p_comm", False)))
    # pipeline ranks as the program names them; the interleaved placement wraps (stage p - 1 -> p: rank p - 1 -> 0)
    peers = {(rank + 1) % p: comm.next_rank, (rank - 1) % p: comm.prev_rank}
    groups = {"pp": comm.pp_group}
    if chunks > 1:
        groups["pp" + p2p.UP] = up_group(comm.pp_group)
    te_dw = [te_modules(m) for m in models]
    last_stage = p * chunks - 1

    def tag(base: str, mb: int, chunk: int) -> str:
        return f"{base}{mb}" + (f"c{chunk}" if chunks > 1 else "")

    tensors: dict = {}  # tag (act<mb>[c<chunk>] / grad<mb>[c<chunk>]) -> tensor received, or to send
    inputs, outputs, requests = {}, {}, {}
    forward_data_store: list = []
    total_num_tokens = torch.zeros([], dtype=torch.int, device=compute_device())
    synced: set = set()
    STORE.clear()
    with STORE.capture(), (torch.no_grad() if forward_only else contextlib.nullcontext()):
        for event in program:
            if event[0] == "post":
                requests[event[1]] = _post(event[2], tensors, peers, groups, shape, config, recorder, event[3])
                continue
            if event[0] == "wait":
                reqs, what = requests.pop(event[1], ((), None))
                if reqs:
                    with _span(recorder, *what):
                        _wait(reqs)
                continue
            op, mb, c = event[1], event[1].microbatch, event[1].chunk
            k = stage_of(placement, p, rank, c)
            key = mb if chunks == 1 else (mb, c)
            if op.kind != "F":
                with _grad_sync(config, mb == num_microbatches - 1):
                    grad_in = _backward_op(op, key, tensors.pop(tag("grad", mb, c)) if k < last_stage and op.kind
                                           != "W" else None, inputs, outputs, config, recorder, te_dw[c])
                if grad_in is not None and k > 0:  # to the previous stage: sent, or handed to this rank's chunk
                    tensors[tag("grad", mb, place(placement, p, k - 1)[1])] = grad_in
                continue
            if c not in synced and isinstance(config.param_sync_func, list):
                config.param_sync_func[c](models[c].parameters())  # Megatron's interleaved: per chunk, first F
            synced.add(c)
            x = tensors.pop(tag("act", mb, c)) if k > 0 else None
            with _span(recorder, "F", mb, c):
                out, tokens = S.forward_step(
                    forward_step_func, iters[c], models[c], num_microbatches, x, forward_data_store, config,
                    cp_group_size=pg.cp.size(), collect_non_loss_data=collect_non_loss_data,
                    is_first_microbatch=S.check_first_val_step(first_val_step, forward_only, mb == 0),
                    current_microbatch=mb, vp_stage=c if chunks > 1 else None, is_last_stage=k == last_stage)
            total_num_tokens += tokens
            if k < last_stage:
                nxt_rank, nxt_chunk = place(placement, p, k + 1)
                # sent by the program's next post, or (the V's turn) this rank's next chunk's input, a leaf as a
                # received activation is
                tensors[tag("act", mb, nxt_chunk)] = out if nxt_rank != rank else out.detach().requires_grad_()
            if not forward_only:
                inputs[key], outputs[key] = x, out
    if requests:
        raise RuntimeError(f"p2p groups never waited: {sorted(requests)}")
    if STORE.pending():
        raise RuntimeError(f"{STORE.pending()} microbatches of weight gradients were never run")
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func(models, total_num_tokens if config.calculate_per_token_loss else None,
                                         pg_collection=pg, force_all_reduce=False)
    return forward_data_store


def _grad_sync(config, last_microbatch: bool):
    """Under ``overlap_grad_reduce`` (Megatron DDP's ``no_sync``/``register_grad_ready``): gradients of every
    microbatch but the last accumulate without marking anything ready; in the last microbatch's B and W every
    parameter is marked ready as its gradient completes (a deferred weight by its W), so each bucket's reduce
    starts right after its last W, on every stage (Megatron's 1F1B starts it in the backward on the first stage
    and leaves the other stages' to their bubble, which zero bubble has not)."""
    if config.no_sync_func is None or last_microbatch:
        return contextlib.nullcontext()
    if isinstance(config.no_sync_func, list):
        stack = contextlib.ExitStack()
        for func in config.no_sync_func:
            stack.enter_context(func())
        return stack
    return config.no_sync_func()


def _backward_op(op, key, grad, inputs: dict, outputs: dict, config, recorder, te_dw):
    """B (input gradient, W queued), BW (both) or W (the oldest queued microbatch's weight gradients); returns
    the input gradient of a B/BW (None on the first stage, and for W)."""
    from megatron.core.pipeline_parallel import schedules as S

    from models.deferred_wgrad import STORE

    if op.kind == "W":
        with _span(recorder, "W", op.microbatch, op.chunk):
            STORE.pop(key)
        return None
    if op.kind not in ("B", "BW"):
        raise ValueError(f"op {op} is not F, B, W or BW")
    x, out = inputs.pop(key), outputs.pop(key)
    S.deallocate_output_tensor(out, config.deallocate_pipeline_outputs)
    with _span(recorder, op.kind, op.microbatch, op.chunk):
        grad_in = S.backward_step(x, out, grad, config)
        STORE.flush(key, te_dw)
        if op.kind == "BW":
            STORE.pop(key)
    return grad_in[0] if isinstance(grad_in, list) else grad_in


_TAG = re.compile(r"(act|grad)(\d+)(?:c(\d+))?$")


def _what(tag: str, direction: str) -> tuple:
    """(span kind, microbatch, chunk) of a p2p tag: send_fwd / recv_bwd ..."""
    base, mb, chunk = _TAG.match(tag).groups()
    return f"{direction}_{'fwd' if base == 'act' else 'bwd'}", int(mb), int(chunk or 0)


def _post(ops, tensors: dict, peers: dict, groups: dict, shape, config, recorder, stream: str = "group") -> tuple:
    """Post one group of the p2p program: as one ``batch_isend_irecv`` (``stream`` "group": NCCL group semantics,
    the ops progress together, so a send and the receive posted with it never wait on each other), or as a single
    ``isend``/``irecv`` ("pair": the rank pair's own communicator of that channel's process group). Receive
    buffers are allocated as Megatron's ``P2PCommunicator`` does (compute device, pipeline dtype, requires_grad)
    and stored under their tag once posted. Returns (requests, span of the wait that completes them)."""
    p2p_ops, received = [], []
    for kind, peer, channel, tag in ops:
        group = groups[channel]
        if kind == "send":
            p2p_ops.append(torch.distributed.P2POp(torch.distributed.isend, tensors.pop(tag), peers[peer], group))
        else:
            buf = torch.empty(shape, requires_grad=True, device=compute_device(), dtype=config.pipeline_dtype)
            tensors[tag] = buf
            p2p_ops.append(torch.distributed.P2POp(torch.distributed.irecv, buf, peers[peer], group))
            received.append(tag)

    def issue():
        if stream == "group":
            return torch.distributed.batch_isend_irecv(p2p_ops)
        return [op.op(op.tensor, op.peer, op.group) for op in p2p_ops]

    sends = [tag for kind, _, _, tag in ops if kind == "send"]
    if sends:
        with _span(recorder, *_what(sends[0], "send")):
            reqs = issue()
    else:
        reqs = issue()
    return reqs, _what(received[0] if received else sends[0], "recv")


def _wait(reqs) -> None:
    for req in (reqs.values() if isinstance(reqs, dict) else reqs or ()):
        req.wait()


# ------------------------------------------------------------------------------------ 1F1B, recorded
@contextlib.contextmanager
def recording_megatron_1f1b(recorder: Recorder):
    """Record Megatron's own 1F1B: its backward_step (looked up in its module at call time) is timed as BW;
    the forward step function is wrapped by :func:`recorded_forward`. Restored on exit."""
    from megatron.core.pipeline_parallel import schedules as S

    original = S.backward_step
    counter = {"b": 0}

    def timed_backward(*args, **kwargs):
        with recorder.span("BW", counter["b"]):
            out = original(*args, **kwargs)
        counter["b"] += 1
        return out

    S.backward_step = timed_backward
    try:
        yield
    finally:
        S.backward_step = original


def recorded_forward(forward_step_func, recorder: Recorder):
    """forward_step_func whose calls (batch, model forward; the loss runs inside Megatron after it) are timed
    as F spans, numbered in call order (1F1B's microbatch order)."""
    counter = {"f": 0}

    def wrapped(data_iterator, model, *args, **kwargs):
        start = recorder.now()
        out, loss_func = forward_step_func(data_iterator, model, *args, **kwargs)
        mb = counter["f"]
        counter["f"] += 1

        def timed_loss(*a, **k):
            result = loss_func(*a, **k)
            recorder.add("F", mb, 0, start, recorder.now())
            return result

        if _holds_loss(model):
            return out, timed_loss
        recorder.add("F", mb, 0, start, recorder.now())
        return out, loss_func

    return wrapped


def _holds_loss(model) -> bool:
    """Whether Megatron will call this chunk's loss function: the chunk holds the output layer (``post_process``,
    as Megatron's forward_step decides by the chunk's virtual stage). Not the rank's ``is_pipeline_last_stage``:
    under interleaving the last rank's other chunks never call it, and their F spans would be lost."""
    from megatron.core.utils import get_attr_wrapped_model

    return bool(get_attr_wrapped_model(model, "post_process"))


# ------------------------------------------------------------------------------------ writing it out
def write_timeline(recorder: Recorder, out_dir, kind: str):
    """Gather every rank's recorded spans; the first rank writes ``spans.json`` (all ranks: ``spans`` of the
    last step, ``steps`` of the last ``Recorder.KEEP`` steps, ``cpu_steps`` their CPU seconds on CPU),
    ``executed.trace.json`` (Chrome/Perfetto) and ``executed.png`` for the pipeline of TP/DP/CP rank 0.
    Collective: every rank calls it. Returns the PNG path on the first rank (None elsewhere)."""
    import json
    from pathlib import Path

    from megatron.core import parallel_state as ps

    from launcher.core.pipeline import timeline

    mine = {"rank": torch.distributed.get_rank(), "pp": ps.get_pipeline_model_parallel_rank(),
            "tp": ps.get_tensor_model_parallel_rank(), "dp": ps.get_data_parallel_rank(),
            "cp": ps.get_context_parallel_rank(), "spans": recorder.spans, "steps": recorder.history,
            "cpu_steps": recorder.cpu_history}
    everyone = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(everyone, mine)
    if torch.distributed.get_rank() != 0:
        return None
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "spans.json").write_text(json.dumps({"kind": kind, "ranks": everyone}))
    pipe = sorted((r for r in everyone if r["tp"] == 0 and r["dp"] == 0 and r["cp"] == 0), key=lambda r: r["pp"])
    timelines = [[tuple(s) for s in r["spans"]] for r in pipe]
    title = f"{kind} executed (PP={len(pipe)})"
    timeline.write_trace(out / "executed.trace.json", [(title, timelines)])
    return timeline.draw(out / "executed.png", [(title, timelines)], time_label="seconds")


__all__ = ["Recorder", "forward_backward_zb_h1", "forward_backward_zb_v", "recording_megatron_1f1b", "recorded_forward", "schedule_1f1b", "write_timeline"]
