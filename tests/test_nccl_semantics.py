"""What NCCL does not forgive, checked on CPU: device discipline of collectives, and p2p orders under NCCL's
blocking-send rules for every pipeline schedule the ranks execute (launcher/core/pipeline/p2p.py,
tests/_nccl_emulation.py, tests/_p2p_fake_rank.py)."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from _rank_harness import TINY, communicate_on_progress, layout, run_train, write_bundle
from launcher.core.pipeline import p2p
from launcher.core.pipeline.schedules import build_schedule

ROOT = Path(__file__).resolve().parents[1]
PPS = (2, 3, 4, 5, 6, 7, 8, 11, 16)
"""The pipeline sizes the replays run: every one to 8, a prime beyond it and 16 (2..16 all: the module took 520
worker-seconds of a CI run; its replays grow as p x m, with m up to 4p, so 9-15 were 60% of them)."""
QUEUES = [None, 1]
"""The replay's queue rules: one per communicator, and CUDA_DEVICE_MAX_CONNECTIONS=1's one per GPU."""
EXECUTED = [("1f1b", 1), ("zb_h1", 1), ("interleaved", 2), ("zb_h1", 2), ("zb_v", 2)]
"""(schedule kind, chunks per rank) of every pipeline program the ranks execute."""


def _microbatches(kind: str, p: int, v: int = 1) -> list:
    # fewer microbatches than stages (partial warm-up), and more than twice as many (a long steady state);
    # over a virtual pipeline, Megatron's microbatch groups (PP) must divide them (but for the V)
    if v > 1 and kind != "zb_v":
        return [p, 2 * p]
    return sorted({max(1, p - 1), 2 * p + 1})


def _placement(kind: str, v: int) -> str:
    return "zb_v" if kind == "zb_v" else "interleaved" if v > 1 else "1f1b"


def _messages(kind: str, p: int, v: int, m: int) -> int:
    """p2p ops matched in one step: every activation and gradient crosses each stage boundary between ranks
    once (ZB-V's turn on the last rank is local)."""
    return 2 * (2 * p - 2) * m if kind == "zb_v" else 2 * (p * v - 1) * m


# ---------------------------------------------------------------------------------- the replay itself
def _unfused(ops, r: int, p: int) -> list:
    """The ZB-H1 executor's order before the fix: receive (blocking) before an op, post its send alone after."""
    prog, lone, n = [], [], 0
    for op in ops:
        before, after = p2p._neighbours(r, p, op)
        for kind, peer, tag in before:
            prog += [("post", (r, n), [(kind, peer, "pp", tag)], "pair"), ("wait", (r, n))]
            n += 1
        prog.append(("op", op))
        for kind, peer, tag in after:
            prog.append(("post", (r, n), [(kind, peer, "pp", tag)], "pair"))
            lone.append((r, n))
            n += 1
    return prog + [("wait", i) for i in lone]


@pytest.mark.parametrize("connections", QUEUES)
@pytest.mark.parametrize("kind", ["zb_h1", "1f1b"])
def test_planned_p2p_programs_replay_without_deadlock_for_pp_2_to_16(kind, connections):
    for p in PPS:
        for m in (1, p - 1, p, 2 * p + 1, 4 * p):
            if m < 1:
                continue
            programs = p2p.plan_all(build_schedule(kind, p, m))
            # every activation and gradient crosses once per stage boundary
            assert p2p.replay(programs, connections) == 2 * (p - 1) * m, (kind, p, m)


@pytest.mark.parametrize("p", [3, 4, 8, 16])
def test_replay_deadlocks_on_the_unfused_send_then_receive_order(p):
    """Finding 3's order: stage r posts 'send activation' then waits on 'receive gradient' while stage r+1 posts
    'send gradient' then waits on 'receive activation' on the same pair: a cycle under NCCL's blocking sends."""
    sched = build_schedule("zb_h1", p, 2 * p)
    with pytest.raises(p2p.Deadlock, match="can never move"):
        p2p.replay([_unfused(ops, r, p) for r, ops in enumerate(sched)])


def test_replay_rules_one_by_one():
    send = lambda item, peer, tag="x": ("post", item, [("send", peer, "pp", tag)], "pair")  # noqa: E731
    recv = lambda item, peer, tag="x": ("post", item, [("recv", peer, "pp", tag)], "pair")  # noqa: E731
    # a lone send completes only with the peer's receive, not into a buffer
    with pytest.raises(p2p.Deadlock):
        p2p.replay([[send((0, 0), 1), ("wait", (0, 0))], [("coll", "w", [0, 1])]])
    # two ranks that both send first deadlock; posting the pair as one group does not
    with pytest.raises(p2p.Deadlock):
        p2p.replay([[send((0, 0), 1), recv((0, 1), 1), ("wait", (0, 1))],
                     [send((1, 0), 0), recv((1, 1), 0), ("wait", (1, 1))]])
    grouped = [[("post", (r, 0), [("send", 1 - r, "pp", "x"), ("recv", 1 - r, "pp", "x")], "group"),
                ("wait", (r, 0))] for r in (0, 1)]
    assert p2p.replay(grouped) == 2
    # on separate communicators the two directions do not block each other (Megatron's PP=2 WORLD trick)
    apart = [[("post", (0, 0), [("send", 1, "pp", "x")], "pair"), ("post", (0, 1), [("recv", 1, "world", "x")],
              "pair"), ("wait", (0, 1))],
             [("post", (1, 0), [("send", 0, "world", "x")], "pair"), ("post", (1, 1), [("recv", 0, "pp", "x")],
              "pair"), ("wait", (1, 1))]]
    assert p2p.replay(apart) == 2
    # ... but under CUDA_DEVICE_MAX_CONNECTIONS=1 every kernel of a GPU runs in launch order on one hardware
    # queue: each rank's send is ahead of its receive, and neither send can complete (NVIDIA/nccl#783)
    with pytest.raises(p2p.Deadlock):
        p2p.replay(apart, connections=1)
    # one queue: a group waits for every group the rank posted before it, on any channel or peer
    chain = [[recv((0, 0), 1, "a"), send((0, 1), 2, "b"), ("wait", (0, 0)), ("wait", (0, 1))],
             [("post", (1, 0), [("recv", 2, "pp", "c")], "pair"), send((1, 1), 0, "a"), ("wait", (1, 0)),
              ("wait", (1, 1))],
             [("post", (2, 0), [("recv", 0, "pp", "b")], "pair"), send((2, 1), 1, "c"), ("wait", (2, 0)),
              ("wait", (2, 1))]]
    assert p2p.replay(chain) == 3  # per pair: every op's partner is at the head of its pair's queue
    with pytest.raises(p2p.Deadlock):
        p2p.replay(chain, connections=1)  # rank 0's send waits behind its receive, which waits on rank 1 ...
    # a collective's kernel queues behind the rank's p2p groups still in flight
    behind = [[send((0, 0), 1), ("coll", "w", [0, 1]), ("wait", (0, 0))],
              [("coll", "w", [0, 1]), recv((1, 0), 0), ("wait", (1, 0))]]
    assert p2p.replay(behind) == 1
    with pytest.raises(p2p.Deadlock):
        p2p.replay(behind, connections=1)
    # matched ops that carry different data are an error, not a silent success
    with pytest.raises(ValueError, match="sends a"):
        p2p.replay([[send((0, 0), 1, "a"), ("wait", (0, 0))], [recv((1, 0), 0, "b"), ("wait", (1, 0))]])


# ---------------------------------------------------------------------------------- what the ranks issue
@pytest.fixture(scope="module")
def fake_rank_traces(tmp_path_factory):
    """One training step of every executed schedule, recorded as each stage of PP 2..16 (one process)."""
    specs = [f"{kind}:{p}:{m}:{v}" for kind, v in EXECUTED for p in PPS for m in _microbatches(kind, p, v)]
    out = tmp_path_factory.mktemp("p2p") / "traces.json"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_p2p_fake_rank.py"), str(out), *specs],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    _, err = communicate_on_progress(proc, 600, "the fake-rank p2p recorder")
    assert proc.returncode == 0, err[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("connections", QUEUES)
@pytest.mark.parametrize("kind,v", EXECUTED)
def test_every_executed_schedule_replays_under_nccl_rules_for_pp_2_to_16(fake_rank_traces, kind, v, connections):
    """Megatron's own 1F1B and interleaved schedules and our zero-bubble executor, as each stage issues them, replay
    under NCCL's rules, with one queue per communicator and with one per GPU (CUDA_DEVICE_MAX_CONNECTIONS=1)."""
    covered = set()
    for spec, programs in fake_rank_traces.items():
        k, p, m, vv = spec.split(":")
        if (k, int(vv)) != (kind, v):
            continue
        assert p2p.replay(programs, connections) == _messages(kind, int(p), v, int(m)), spec
        covered.add(int(p))
    assert covered == set(PPS)


def test_zero_bubble_executor_issues_exactly_the_planned_program(fake_rank_traces):
    """The executor posts the groups the plan derives, in its order, on the planned channels (tags aside: the trace
    knows sizes): ZB-H1, ZB-H1 over a virtual pipeline, ZB-V."""
    seen = set()
    for spec, programs in fake_rank_traces.items():
        kind, p, m, v = spec.split(":")
        if kind not in ("zb_h1", "zb_v"):
            continue
        seen.add((kind, int(v)))
        planned = p2p.plan_all(build_schedule(kind, int(p), int(m), int(v), int(p)), placement=_placement(kind, int(v)))
        for r, (executed, plan) in enumerate(zip(programs, planned)):
            shape = [(ev[0], [tuple(o[:3]) for o in ev[2]] if ev[0] == "post" else tuple(ev[1])) for ev in executed]
            want = [(ev[0], [tuple(o[:3]) for o in ev[2]] if ev[0] == "post" else tuple(ev[1]))
                    for ev in plan if ev[0] != "op"]
            assert shape == want, f"{spec} rank {r}"
    assert seen == {("zb_h1", 1), ("zb_h1", 2), ("zb_v", 2)}


def _emulated_run(tmp_path: Path, name: str, nproc: int, overrides: list) -> dict:
    """A real torchrun job with NCCL's device rule enforced and every p2p op and collective recorded."""
    bundle = write_bundle(tmp_path / name, overrides, nproc)
    trace = tmp_path / f"{name}-trace"
    env = dict(LAUNCHER_NCCL_EMULATION="1", LAUNCHER_P2P_TRACE=str(trace),
               PYTHONPATH=os.pathsep.join([str(ROOT / "tests" / "_nccl_site"), os.environ.get("PYTHONPATH", "")]))
    proc = run_train(bundle, nproc, 300, env=env, what=f"torchrun of {name} under the NCCL emulation")
    assert proc.returncode == 0, \
        f"{name} failed under the NCCL emulation:\n{proc.stdout[-2000:]}\n{proc.stderr[-5000:]}"
    traces = {r: json.loads((trace / f"rank-{r}.json").read_text())["events"] for r in range(nproc)}
    # request ids count per process: make them (rank, id), as launcher.core.pipeline.p2p.replay keys groups
    return {r: [(ev[0], (r, ev[1]), *ev[2:]) if ev[0] in ("post", "wait") else tuple(ev) for ev in events]
            for r, events in traces.items()}


def _p2p_only(events: list, p: int) -> list:
    """Posts and waits, item ids renumbered per rank, the pipeline groups named alike, sizes
    dropped (the stand-in stage is smaller), one wait per group (a batch returns one request per op)."""
    ids, out, waited = {}, [], set()
    pp = "g" + "-".join(str(r) for r in range(p))
    for ev in events:
        key = tuple(ev[1]) if ev[0] in ("post", "wait") and isinstance(ev[1], (list, tuple)) else ev[1]
        if ev[0] == "post":
            ids[key] = len(ids)
            # ZB-V's second channel has the pipeline group's ranks (a real run names both alike): the direction says it
            out.append(("post", ids[key], [(o[0], o[1], "pp" if o[2] in (pp, "pp" + p2p.UP) else o[2])
                                           for o in ev[2]], ev[3]))
        elif ev[0] == "wait" and key in ids and key not in waited:
            waited.add(key)
            out.append(("wait", ids[key]))
    return out


@pytest.mark.parametrize("name,nproc,kind,vpp", [("zb_h1_pp4", 4, "zb_h1", 1), ("interleaved_pp2_vp2", 2,
                                                                                   "interleaved", 2),
                                                 ("zb_v_pp2", 2, "zb_v", 2)])
def test_real_ranks_issue_the_recorded_order_and_keep_nccl_device_rules(tmp_path, fake_rank_traces, name, nproc,
                                                                       kind, vpp):
    """A real multi-process job (checkpoint save and resume probes, loss reduction, the pipeline schedule) under
    the emulation: no host tensor reaches a collective, and each step's p2p events are exactly those the
    one-process recorder saw for that stage, so the PP 2..16 replay above is of what ranks really do."""
    steps, m = 2, _microbatches(kind, nproc, vpp)[0]  # a microbatch count the fake-rank sweep recorded
    overrides = [*TINY, *layout(pp=nproc), f"schedule.kind={kind}", f"train.train_steps={steps}",
                 "checkpoint.save_at_end=true", f"model.num_layers={nproc * vpp * 1}",
                 f"train.global_batch_size={2 * m}"]
    if vpp > 1:
        overrides.append(f"parallel.virtual_pipeline={vpp}")
    traces = _emulated_run(tmp_path, name, nproc, overrides)
    for connections in QUEUES:  # the whole run, collectives included
        p2p.replay([traces[r] for r in range(nproc)], connections)
    recorded = fake_rank_traces[f"{kind}:{nproc}:{m}:{vpp}"]
    for r in range(nproc):
        one_step = _p2p_only(recorded[r], nproc)
        executed = _p2p_only(traces[r], nproc)
        assert len(executed) == steps * len(one_step), f"rank {r}: {len(executed)} events vs {len(one_step)}/step"
        n = len(one_step)
        for step in range(steps):
            assert [(e[0], e[2], e[3]) if e[0] == "post" else e[:1] for e in executed[step * n:(step + 1) * n]] == \
                [(e[0], e[2], e[3]) if e[0] == "post" else e[:1] for e in one_step], \
                f"rank {r} step {step + 1}: the real rank's p2p order differs from the recorded one"


# ---------------------------------------------------------------------------------- device discipline
def test_emulation_refuses_a_host_tensor_in_a_collective_like_nccl(tmp_path):
    script = r"""
import os, sys
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import _nccl_emulation as emu
emu.install()
import torch, torch.distributed as dist
from models.backend import compute_device
dist.init_process_group("gloo", rank=0, world_size=1, init_method="file://" + sys.argv[1])
results = []
for make in (lambda: torch.tensor([1.0]),                                  # host: refused
             lambda: torch.tensor([1.0], dtype=torch.float64).double(),  # dtype only: still host
             lambda: torch.tensor([1.0], device=compute_device()),       # on the compute device
             lambda: torch.zeros(2).to(compute_device()),                # moved there
             lambda: torch.tensor([1.0], device="cpu"),                   # host, said explicitly: refused
             lambda: torch.zeros(2, device=compute_device()).cpu(),       # copied to the host: refused
             lambda: torch.zeros(2, device=compute_device()).to("cpu"),   # the same: refused
             lambda: torch.zeros_like(torch.zeros(2)),                    # like a host tensor: refused
             lambda: torch.zeros(2).new_zeros(3),                         # new_* of a host tensor: refused
             lambda: torch.ones_like(torch.zeros(2), device="cpu"),       # like anything, on the host: refused
             lambda: torch.zeros_like(torch.zeros(2, device=compute_device())),  # like a device tensor
             lambda: torch.zeros(2, device=compute_device()).new_full((3,), 1.0)):  # new_* of one
    try:
        dist.all_reduce(make()); results.append("ok")
    except emu.NcclDeviceError:
        results.append("refused")
gloo = dist.new_group([0], backend="gloo")
dist.all_reduce(torch.zeros(1), group=gloo); results.append("gloo group ok")
print(results, flush=True)
# tear the groups down before the interpreter does: left to exit, a gloo thread was once destroyed while running
# ("terminate called without an active exception", SIGABRT after the results; suite_under_load at load 24)
dist.destroy_process_group()
"""
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "init")], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(["refused", "refused", "ok", "ok"] + ["refused"] * 6
                                                       + ["ok", "ok", "gloo group ok"])


RANK_WING = ["launcher/rank", "models", "data/rank.py"]
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "from_numpy", "rand", "randn",
             "randint", "linspace", "eye"}
HOST_TENSORS_ALLOWED = {
    ("launcher/rank/metrics.py", "randn"): "matmul probe operands, moved to the device by the caller before use",
    ("launcher/rank/data.py", "as_tensor"): "the DataLoader's collate builds CPU batches; forward_step moves "
                                            "them to compute_device() before the model sees them",
}


def _factory_calls_without_device():
    for base in RANK_WING:
        paths = [ROOT / base] if base.endswith(".py") else sorted((ROOT / base).rglob("*.py"))
        for path in paths:
            if not path.exists():
                continue
            tree = ast.parse(path.read_text())
            for node in ast.walk(tree):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                        and node.func.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords)):
                    yield path.relative_to(ROOT).as_posix(), node.func.attr, node.lineno


EXPLICIT_HOST_ALLOWED = {
    ("models/builder.py", 'device="cpu"'): "the routed experts' seed drawn from a CPU generator (a Python int; on "
                                           "the meta device of import-hf a default-device draw has no value), no "
                                           "tensor leaves",
    ("launcher/rank/checkpoint/convert.py", 'device="cpu"'): "read_all's and Source's buffers are filled from files "
                                                             "and sliced on the host, then copied onto each live "
                                                             "tensor's device",
    ("launcher/rank/checkpoint/store.py", ".cpu()"): "the gathered byte counts become Python ints (tolist) after the "
                                               "collective, never before one",
    ("models/backend.py", 'torch.device("cpu")'): "compute_device() itself, without CUDA",
    ("models/cpu_compat.py", 'torch.device("cpu")'): "the CPU bridge's stand-in for a CUDA device (no CUDA: the "
                                                     "compute device is the CPU)",
}


def _explicit_host_tensors():
    """``device="cpu"``, ``torch.device("cpu")`` and ``.cpu()`` in the rank wing: each makes a host tensor on a GPU
    rank as surely as a factory call without device= does."""
    for base in RANK_WING:
        paths = [ROOT / base] if base.endswith(".py") else sorted((ROOT / base).rglob("*.py"))
        for path in paths:
            if not path.exists():
                continue
            rel = path.relative_to(ROOT).as_posix()
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                if any(k.arg == "device" and isinstance(k.value, ast.Constant) and str(k.value.value).startswith("cpu")
                       for k in node.keywords):
                    yield rel, 'device="cpu"', node.lineno
                if isinstance(node.func, ast.Attribute) and node.func.attr == "cpu" and not node.args:
                    yield rel, ".cpu()", node.lineno
                if (isinstance(node.func, ast.Attribute) and node.func.attr == "device"
                        and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch" and node.args
                        and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).startswith("cpu")):
                    yield rel, 'torch.device("cpu")', node.lineno


def test_rank_wing_names_the_host_only_where_listed():
    """An explicit host tensor in the rank wing (``device="cpu"``, ``torch.device("cpu")``, ``.cpu()``) is listed
    with why it never reaches a collective; the emulation refuses the ones that do (test above)."""
    found = [(path, what, line) for path, what, line in _explicit_host_tensors()
             if (path, what) not in EXPLICIT_HOST_ALLOWED]
    assert not found, f"explicit host tensors in the rank wing: {found}"
    stale = set(EXPLICIT_HOST_ALLOWED) - {(path, what) for path, what, _ in _explicit_host_tensors()}
    assert not stale, f"allow-list entries that no longer match a call: {stale}"


def test_rank_wing_makes_no_host_tensor_outside_the_allow_list():
    """Every torch factory call in the rank wing names its device (compute_device() for anything that may
    reach a collective), or is listed above with why a host tensor is right there."""
    found = [(path, fn, line) for path, fn, line in _factory_calls_without_device()
             if (path, fn) not in HOST_TENSORS_ALLOWED]
    assert not found, f"torch factory calls without device= in the rank wing: {found}"
    stale = set(HOST_TENSORS_ALLOWED) - {(path, fn) for path, fn, _ in _factory_calls_without_device()}
    assert not stale, f"allow-list entries that no longer match a call: {stale}"


@pytest.mark.parametrize("connections", QUEUES)
@pytest.mark.parametrize("costs", [(1, 1, 1), (0.77, 1, 0.49), (1, 2, 1)])
def test_zb_v_programs_replay_without_deadlock_for_pp_2_to_16(costs, connections):
    """ZB-V (two chunks per rank in a V): each rank pair carries activations and gradients both ways, so every
    rank posts its sends and receives in one global order of the messages (p2p._plan_in_time_order); every
    message crosses once (2 x (2p - 2) per microbatch: the V's turn on the last rank is local)."""
    for p in PPS:
        for m in (1, p, 2 * p + 1, 4 * p):
            sched = build_schedule("zb_v", p, m, costs=costs)
            for overlap in (False, True):
                programs = p2p.plan_all(sched, placement="zb_v", overlap=overlap)
                assert p2p.replay(programs, connections) == 2 * (2 * p - 2) * m, (p, m, overlap)


def test_zb_v_orders_for_per_stage_costs_replay_without_deadlock_for_pp_2_to_16():
    """schedule.zb_v_costs with one triple per stage (rank 0's two stages, embedding and loss, 30% dearer; and a
    skew across the ranks): the orders generated for them, the mean triple's among the candidates, replay under
    NCCL's rules as the equal-cost ones do."""
    for p in PPS:
        heavy = [1.3 if s in (0, 2 * p - 1) else 1.0 for s in range(2 * p)]
        skew = [1 + 0.1 * min(s, 2 * p - 1 - s) / p for s in range(2 * p)]
        for scale in (heavy, skew):
            costs = tuple(c * x for x in scale for c in (0.7, 1, 0.6))
            for m in (p, 2 * p + 1, 4 * p):
                sched = build_schedule("zb_v", p, m, costs=costs)
                for connections in QUEUES:
                    assert p2p.replay(p2p.plan_all(sched, placement="zb_v"), connections) == 2 * (2 * p - 2) * m


def _ops_between_post_and_wait(program: list) -> list:
    """For each receive: how many ops run between its post and its wait."""
    posted, out = {}, []
    for i, ev in enumerate(program):
        if ev[0] == "post" and ev[2][0][0] == "recv":
            posted[ev[1]] = i
        elif ev[0] == "wait" and ev[1] in posted:
            out.append(sum(1 for e in program[posted.pop(ev[1]):i] if e[0] == "op"))
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_zb_h1_over_a_virtual_pipeline_replays_without_deadlock_for_pp_2_to_16(overlap):
    """ZB-H1 over VPP 2 and 3 (Megatron's interleaved placement: stage p - 1 hands over to rank 0, so a rank pair
    carries messages both ways, as in the V): every rank posts in one global order of the messages, and with
    overlap_p2p_comm each receive as early as that order allows; every message crosses once (2 x (pv - 1) per
    microbatch), under either queue rule."""
    for p in PPS:
        for v in (2, 3):
            for m in (p, 2 * p):
                sched = build_schedule("zb_h1", p, m, v)
                programs = p2p.plan_all(sched, placement="interleaved", overlap=overlap)
                for connections in QUEUES:
                    assert p2p.replay(programs, connections) == 2 * (p * v - 1) * m, (p, v, m)
                early = [n for prog in programs for n in _ops_between_post_and_wait(prog)]
                if overlap:  # receives in flight under compute: posted one or more ops before they are needed
                    assert max(early) >= 1
                else:  # posted right before the op consuming it, unless the order needs it earlier
                    assert sum(n == 0 for n in early) > len(early) // 2


def test_every_zb_v_variant_replays_without_deadlock():
    """schedule_zb_v picks one of several list-scheduling variants by the costs it is given, so every variant's
    order (at costs that select each: equal, W cheap, F cheap, F cheaper than B and W) must replay under NCCL's rules, with and without
    overlapped receives."""
    from launcher.core.pipeline.schedules import _zb_v, zb_v_variants

    for p in (2, 3, 4, 8):
        for m in (1, p, 2 * p + 1):
            for costs in ((1.0, 1.0, 1.0), (1.0, 1.0, 0.5), (0.6, 1.0, 0.45), (0.75, 1.0, 0.97)):
                for rule in zb_v_variants(p):
                    sched = [list(ops) for ops in _zb_v(p, m, costs, *rule)[0]]
                    for overlap in (False, True):
                        programs = p2p.plan_all(sched, placement="zb_v", overlap=overlap)
                        for connections in QUEUES:
                            assert p2p.replay(programs, connections) == 2 * (2 * p - 2) * m, \
                                (p, m, costs, rule, overlap, connections)


def _sends_early(program: list) -> list:
    """The program with every send posted right after the op producing it, ahead of receives the global order
    put first: one send more in flight on the rank's queue (the order ZB-V and ZB-H1 over a virtual pipeline
    were posted in before the one-queue rule)."""
    out = [ev for ev in program if not (ev[0] == "post" and ev[2][0][0] == "send")]
    for k, ev in enumerate(program):
        if ev[0] == "post" and ev[2][0][0] == "send":
            producer = max(i for i, e in enumerate(program[:k]) if e[0] == "op")
            at = out.index(program[producer]) + 1
            while out[at][0] == "post" and out[at][2][0][0] == "send":
                at += 1  # behind the sends of the same op, in their order
            out.insert(at, ev)
    return out


@pytest.mark.parametrize("kind,v", [("zb_v", 2), ("zb_h1", 2)])
def test_one_send_too_many_in_flight_hangs_under_one_queue(kind, v):
    """Sends posted as soon as produced (the receiving side unchanged) still complete with one queue per
    communicator, so the old rule could not see it; with CUDA_DEVICE_MAX_CONNECTIONS=1 they deadlock."""
    hung = 0
    for p in (2, 3, 4, 8):
        sched = build_schedule(kind, p, 2 * p, v, p)
        programs = [_sends_early(prog) for prog in p2p.plan_all(sched, placement=_placement(kind, v))]
        assert programs != p2p.plan_all(sched, placement=_placement(kind, v))
        p2p.replay(programs)  # per-communicator queues: fine
        try:
            p2p.replay(programs, connections=1)
        except p2p.Deadlock:
            hung += 1
    assert hung >= 3, hung


def test_programs_over_several_chunks_need_every_ranks_op_list():
    """Without the peers' op lists no rank can know the global order of the messages: refused, not guessed."""
    sched = build_schedule("zb_v", 4, 8)
    with pytest.raises(ValueError, match="every rank's op list"):
        p2p.plan(sched[1], 1, 4, placement="zb_v")


def _zero_bubble_jobs() -> list:
    """(name, overrides) of every zero-bubble job the launcher offers: the search candidates of the golden searches
    (Llama3-70B on 16 H100 nodes, Qwen3-30B-A3B on 16 H100s) and each catalogue recipe's ZB-H1 and ZB-V variants
    (benchmarks/zb_recipes.py, the README's zero-bubble table, ZB-V with the planner's own zb_v_costs)."""
    from test_search_golden import CASES

    jobs = []
    for case, (args, _) in CASES.items():
        golden = json.loads((ROOT / "tests" / "golden" / f"search_{case}.json").read_text())
        jobs += [(f"{case} #{i}", [*args, *c["overrides"]]) for i, c in enumerate(golden)
                 if any(o in c["overrides"] for o in ("schedule.kind=zb_h1", "schedule.kind=zb_v"))]
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import zb_recipes
    from launcher.config import RECIPES_DIR, compose_job

    for name in sorted(p.stem for p in (RECIPES_DIR / "recipe").glob("*.yaml")):
        job = compose_job([f"recipe={name}"])
        if job.parallel.pipeline > 1:
            jobs += [(f"{name} {kind}", zb_recipes.row(name, overrides)["overrides"] + [f"recipe={name}"])
                     for kind, overrides in zb_recipes.variants(job)]
    return jobs


def test_every_zero_bubble_job_offered_replays_under_one_queue():
    """Every zero-bubble layout the search returns and every catalogue variant, with the op order and p2p program
    its ranks would run (the layout's PP, microbatches, VPP, microbatch group and zb_v_costs), completes under
    CUDA_DEVICE_MAX_CONNECTIONS=1's one queue per GPU."""
    from launcher.config import compose_job
    from launcher.core import derive

    seen = {"zb_h1": 0, "zb_v": 0, "zb_h1 over chunks": 0}
    for name, overrides in _zero_bubble_jobs():
        job = compose_job(overrides)
        lay = derive(job)
        kind, p, v = job.schedule.kind, lay.pp, lay.vpp or 1
        sched = build_schedule(kind, p, lay.microbatches, v, lay.microbatch_group,
                               tuple(job.schedule.zb_v_costs or (1.0, 1.0, 1.0)))
        programs = p2p.plan_all(sched, placement=_placement(kind, v), overlap=job.schedule.overlap_p2p_comm)
        assert p2p.replay(programs, connections=1) == _messages(kind, p, v, lay.microbatches), name
        seen["zb_h1 over chunks" if kind == "zb_h1" and v > 1 else kind] += 1
    assert min(seen.values()) >= 2, seen  # every kind among them (one chunk: the catalogue recipes without VPP)
