"""Hang forensics (launcher/rank/forensics.py, launcher/rank/watchdog.py): a rank that stops inside the
collectives of a real 4-rank gloo job is named, with its pipeline stage and data-parallel rank and the collective
the others wait in, within the derived hang threshold; every other rank's stacks land in the bundle; the run
stops with that line."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _rank_harness import ROOT, TINY, communicate_on_progress, run_with_a_stopped_rank
from launcher.rank import forensics, watchdog


def _state(rank, step, groups, current, coords=None, pid=None, host="h"):
    return {"rank": rank, "pid": pid or os.getpid(), "host": host, "step": step, "groups": groups,
            "current": current, "coords": coords or {"pp": rank // 2, "dp": 0, "tp": rank % 2, "cp": 0,
                                                     "pp_size": 2, "dp_size": 1}}


def test_analysis_names_the_rank_that_never_entered_the_collective():
    states = [_state(0, 7, {"0-1-2-3": [40, "all_reduce", "in"]}, "0-1-2-3"),
              _state(1, 7, {"0-1-2-3": [40, "all_reduce", "in"]}, "0-1-2-3"),
              _state(2, 7, {"0-1-2-3": [39, "all_reduce", "out"], "2-3": [12, "all_gather", "in"]}, "2-3"),
              _state(3, 7, {"0-1-2-3": [40, "all_reduce", "in"], "2-3": [11, "all_gather", "out"]}, "0-1-2-3")]
    line = watchdog.analyse(states, silent=set())
    # rank 2 waits in [2-3] for rank 3, which waits in the all_reduce for rank 2: a cycle, said as one
    assert line == ("ranks 2, 3 wait on each other (collectives called in different orders): rank 2 is inside "
                    "all_gather #12 of group [2-3], which rank 3 never entered; rank 3 is inside all_reduce #40 of "
                    "group [0-1-2-3], which rank 2 never entered"), line
    # the chain: rank 3 waits for rank 2 in [2-3]; rank 2 is inside nothing and answers: the chain's end is named
    states[2]["current"] = None
    states[2]["groups"]["2-3"] = [11, "all_gather", "out"]
    states[3].update(current="2-3", groups={"0-1-2-3": [40, "all_reduce", "in"], "2-3": [12, "all_gather", "in"]})
    states[3]["groups"]["0-1-2-3"] = [40, "all_reduce", "out"]
    line = watchdog.analyse(states, silent=set())
    assert line.startswith("rank 2 (host h, pipeline stage 1, data-parallel rank 0) never entered all_reduce #40 of "
                           "group [0-1-2-3] that 2 ranks are waiting in; it is inside no collective"), line
    # a rank that stopped answering outside every collective is named even where the chain cannot reach it
    line = watchdog.analyse(states, silent={1}, proc_states={1: "T"})
    assert line == ("rank 1 (host h, pipeline stage 0, data-parallel rank 0, tensor rank 1) stopped responding "
                    "inside all_reduce #40 of group [0-1-2-3] (process state T); 2 ranks wait in all_reduce #40 of "
                    "group [0-1-2-3], which rank 2 never entered"), line


def test_analysis_names_a_rank_that_entered_and_stopped_answering():
    states = [_state(r, 3, {"0-1": [5, "broadcast", "in"]}, "0-1") for r in (0, 1)]
    line = watchdog.analyse(states, silent={1}, proc_states={1: "T"})
    assert line.startswith("rank 1 (host h, pipeline stage 0, data-parallel rank 0, tensor rank 1) stopped "
                           "responding inside broadcast #5 of group [0-1] (process state T); 2 ranks wait in "
                           "broadcast #5 of group [0-1]"), line
    assert "none is behind" in watchdog.analyse(states, silent=set())


_SLEEPER = """
import sys, time
sys.path.insert(0, {root!r})
from launcher.rank import forensics
rec = forensics.install({bundle!r}, {rank}, count_collectives=False)
rec.set(step=4, coords={{"pp": {rank}, "dp": 0, "tp": 0, "cp": 0, "pp_size": 2, "dp_size": 1}})
rec.state["groups"] = {{"0-1": [9, "all_reduce", "in"] if {rank} == 0 else [8, "all_reduce", "out"]}}
rec.set(current="0-1" if {rank} == 0 else None)
print("ready", flush=True)
time.sleep(120)
"""


def test_watchdog_dumps_stacks_and_reports_once_nothing_moves(tmp_path):
    """Two processes with real state files and faulthandler: rank 0 waits in all_reduce #9, rank 1 (stopped
    with SIGSTOP) never entered it. The watchdog, armed (step 4), fires after its threshold and not before."""
    procs = []
    for rank in (0, 1):
        p = subprocess.Popen([sys.executable, "-c", _SLEEPER.format(root=str(ROOT), bundle=str(tmp_path), rank=rank)],
                             stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline().strip() == "ready"
        procs.append(p)
    os.kill(procs[1].pid, signal.SIGSTOP)
    lines = []
    try:
        dog = watchdog.Watchdog(tmp_path, 2.0, lines.append, poll_s=0.2)
        started = time.monotonic()
        dog.start()
        dog.join(timeout=60)
        took = time.monotonic() - started
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert lines and dog.line == lines[0] and took >= 2.0
    assert re.match(r"hang at step 4: rank 1 \(host \S+, pipeline stage 1, data-parallel rank 0\) never entered "
                    r"all_reduce #9 of group \[0-1\] that 1 rank is waiting in and does not answer \(process state T: "
                    r"stopped\?\) "
                    r"\(no collective progress for \d+ s; named from the launcher's collective counters\); stacks: "
                    r".*/hang-4/$", lines[0]), lines[0]
    hang = tmp_path / "hang-4"
    assert 'File "<string>", line 10 in <module>' in (hang / "stacks-rank-0.txt").read_text()  # its time.sleep line
    assert not (hang / "stacks-rank-1.txt").exists()  # the stopped one could not answer
    report = json.loads((hang / "report.json").read_text())
    assert report["silent"] == [1] and report["process_states"]["1"] == "T" and report["line"] == lines[0]


def test_watchdog_is_not_armed_before_the_first_step(tmp_path):
    rec = forensics.Recorder(tmp_path, 0)  # step 0: the first step's allowance is the process group's timeout
    rec.set(current="0", groups={"0": [1, "barrier", "in"]})
    lines = []
    dog = watchdog.Watchdog(tmp_path, 0.5, lines.append, poll_s=0.1)
    dog.start()
    time.sleep(2.0)
    dog.stop()
    dog.join(5)
    assert not lines


@pytest.fixture
def hung_run(tmp_path, cli):
    """The embedded default's layout (TP2 x PP2, 4 gloo ranks) on the tiny model, run by its launch.sh (so the
    agent's watchdog runs), with rank 2 stopped (SIGSTOP) once step 3 is logged."""
    overrides = [*TINY, "parallel.tensor=2", "parallel.pipeline=2", "cluster.gpus_per_node=4", "model.num_layers=2",
                 "train.train_steps=100000", "train.eval_interval=0", "checkpoint.save_interval=0",
                 "checkpoint.save_at_end=false", "timeouts.hang_s=20"]
    code, out, err = cli(*overrides, "action=render", f"output_dir={tmp_path}")
    assert code == 0, err or out
    bundle = next(tmp_path.glob("*/launch.sh")).parent
    assert "export LAUNCHER_HANG_S=20" in (bundle / "env.sh").read_text()
    with run_with_a_stopped_rank(bundle, rank=2) as proc:
        out, err = communicate_on_progress(proc, 300, "the hung run (the watchdog should stop it)")
        yield bundle, proc.returncode, out, err


def test_a_stopped_rank_is_named_and_the_run_stops(hung_run):
    bundle, code, out, err = hung_run
    said = [line for line in err.splitlines() if line.startswith("hang watchdog: ")]
    assert code != 0 and len(said) == 1, (code, out[-2000:], err[-3000:])
    line = said[0].removeprefix("hang watchdog: ")
    # named from the live ranks' Flight Recorder traces: the collective (its torch name and sequence number in its
    # group) that the stopped rank's peers wait in
    assert re.match(r"hang at step \d+: rank 2 \(host \S+, pipeline stage 1, data-parallel rank 0 of group "
                    r"\[2\]\) (never entered|stopped responding inside) \w+ #\d+ of group \[[\d-]*2[\d-]*\] that "
                    r"\d ranks? (is|are) waiting in; it left no Flight Recorder trace \(process state T: stopped\?\) "
                    r"\(no collective progress for \d+ s; named from the Flight Recorder traces of ranks 0, 1, 3\)",
                    line), line
    hang = Path(line.rsplit("stacks: ", 1)[1].rstrip("/"))
    assert hang.parent == bundle and (hang / "report.json").is_file()
    assert sorted(p.name for p in (hang / "fr").iterdir()) == ["rank_0", "rank_1", "rank_3"]  # the stopped one: none
    for rank in (0, 1, 3):  # every rank that could answer left all its threads' stacks
        assert "Thread" in (hang / f"stacks-rank-{rank}.txt").read_text() or \
            "Current thread" in (hang / f"stacks-rank-{rank}.txt").read_text()
    assert not (hang / "stacks-rank-2.txt").exists()
    assert (bundle / "FAILED").read_text().strip() == line
    assert f"launcher: failed: {line}" in out


def test_the_verdict_names_the_culprit_rank_where_one_rank_is_it():
    """slurm.on_hang=exclude leaves out the culprit's node: the verdict gives that rank (None for a cycle, where no
    single rank is to blame, and where every member waits)."""
    states = [_state(r, 3, {"0-1": [5, "broadcast", "in"]}, "0-1", host=f"node-{r}") for r in (0, 1)]
    assert watchdog.verdict(states, silent={1}, proc_states={1: "T"})[1] == 1
    assert watchdog.verdict(states, silent=set())[1] is None
    cycle = [_state(2, 7, {"0-1-2-3": [39, "all_reduce", "out"], "2-3": [12, "all_gather", "in"]}, "2-3"),
             _state(3, 7, {"0-1-2-3": [40, "all_reduce", "in"], "2-3": [11, "all_gather", "out"]}, "0-1-2-3")]
    assert watchdog.verdict(cycle, silent=set())[1] is None


def test_the_culprits_node_is_recorded_once(tmp_path):
    watchdog.record_culprit_node(tmp_path, {"rank": 5, "host": "gpu-0153"})
    watchdog.record_culprit_node(tmp_path, {"rank": 9, "host": "gpu-0200"})  # a second node's watchdog: too late
    watchdog.record_culprit_node(tmp_path, None)
    assert (tmp_path / watchdog.HANG_NODE).read_text() == "gpu-0153\n"
    assert [p.name for p in tmp_path.iterdir()] == [watchdog.HANG_NODE]


def test_a_hang_under_slurm_resubmits_the_job_without_the_culprits_node(slurm_cluster, tmp_path):
    """The real one-node Slurm: rank 2 stopped; the watchdog names it, and the batch script submits the bundle
    again as a new job with this node excluded, records it in hangs.jsonl, and submission.json follows the new job.
    The batch script's own `sbatch` is a recorder on PATH (the job inherits the submitter's PATH): a cluster of one
    node has no other to run the new job, so the real sbatch refuses it ("Requested node configuration is not
    available", which the script then reports); everything before that last hop is the real job's."""
    from test_slurm_localhost import job_info, log_of, render

    stub = tmp_path / "bin"
    stub.mkdir()
    record = tmp_path / "sbatch-args"
    (stub / "sbatch").write_text(f'#!/bin/bash\nprintf "%s\\n" "$@" > {record}\n'
                                 f'env | grep ^LAUNCHER_ | sort > {record}.env\necho 424242\n')
    (stub / "sbatch").chmod(0o755)
    bundle = render(tmp_path, "data=mock", "model.num_layers=2", "model.hidden_size=64", "model.ffn_hidden_size=128",
                    "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=64",
                    "train.train_steps=100000", "train.eval_interval=0", "checkpoint.save_interval=0",
                    "checkpoint.save_at_end=false", "timeouts.hang_s=20", "slurm.on_hang=exclude",
                    "slurm.time=00:30:00", "slurm.signal_lead_s=60")
    env = dict(os.environ, PATH=f"{stub}{os.pathsep}{os.environ['PATH']}")
    real = shutil.which("sbatch")  # the real one submits; the job, inheriting PATH, finds the recorder first
    first = subprocess.run([real, "--parsable", str(bundle.sbatch)], capture_output=True, text=True, timeout=60,
                           check=True, env=env).stdout.strip().split(";")[0]
    stopped = None
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and stopped is None:
            if re.search(r"^step +3 \|", log_of(bundle, first), re.MULTILINE):
                stopped = int(json.loads(forensics.state_path(bundle.path, 2).read_bytes())["pid"])
                os.kill(stopped, signal.SIGSTOP)
            assert job_info(first).get("JobState") not in ("FAILED", "COMPLETED", "CANCELLED"), log_of(bundle, first)
            time.sleep(0.5)
        assert stopped is not None, log_of(bundle, first)[-4000:]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and job_info(first).get("JobState") in ("RUNNING", "COMPLETING", "PENDING"):
            time.sleep(1)
        log = log_of(bundle, first)
        node = socket.gethostname()
        assert (f"launcher: hang on node {node}; submitted job 424242 to resume without it (--exclude={node}, "
                "resubmission 1 of 3)") in log, log[-6000:]
        assert (bundle.path / "HANG_NODE").read_text().strip() == node
        args = record.read_text().splitlines()
        assert f"--exclude={node}" in args and args[-1] == str(bundle.sbatch), args
        exported = record.with_name(record.name + ".env").read_text().splitlines()
        assert f"LAUNCHER_EXCLUDED_NODES={node}" in exported and "LAUNCHER_HANG_RESUBMITS=1" in exported, exported
        [entry] = [json.loads(line) for line in (bundle.path / "hangs.jsonl").read_text().splitlines()]
        assert entry["job"] == first and entry["next_job"] == "424242" and entry["node"] == node
        assert entry["line"].startswith("hang at step ") and "rank 2 " in entry["line"], entry
        assert json.loads((bundle.path / "submission.json").read_text()) == {"job_id": "424242"}
    finally:
        subprocess.run(["scancel", first], capture_output=True, timeout=30)
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except OSError:
                pass


_FR_RANK = """
import os, sys, time
sys.path.insert(0, {root!r})
os.environ["TORCH_FR_BUFFER_SIZE"] = "2000"  # env.sh's (launcher/core/timeouts.py fr_env): before the group exists
from launcher.rank import forensics, signals
signals.STATE.install()
forensics.install({bundle!r}, {rank}, count_collectives=True)
import torch, torch.distributed as dist
dist.init_process_group("gloo", init_method="file://{store}", rank={rank}, world_size=3)
t = torch.ones(2)
for _ in range(3):
    dist.all_reduce(t)
if {rank} != 1:  # rank 1 never enters all_reduce #4
    dist.all_reduce(t)
time.sleep(300)
"""


@pytest.fixture(scope="module")
def fr_traces(tmp_path_factory):
    """Three real gloo ranks: 0 and 2 wait in all_reduce #4 of the world group, rank 1 (alive) never entered it.
    Each is asked with the watchdog's signal and writes its real Flight Recorder trace."""
    bundle = tmp_path_factory.mktemp("fr")
    procs = [subprocess.Popen([sys.executable, "-c", _FR_RANK.format(root=str(ROOT), bundle=str(bundle),
                                                                     store=bundle / "store", rank=r)])
             for r in range(3)]
    try:
        deadline = time.monotonic() + 300
        inside = lambda r: (json.loads(forensics.state_path(bundle, r).read_bytes() or b"{}").get("groups", {})
                            .get("0-1-2", [0])[0] == 4)
        while time.monotonic() < deadline and not all(forensics.state_path(bundle, r).exists() and inside(r)
                                                      for r in (0, 2)):
            assert all(p.poll() is None for p in procs), "a rank ended"
            time.sleep(0.2)
        time.sleep(0.5)  # the counter is set just before the all_reduce is entered
        for p in procs:
            os.kill(p.pid, forensics.DUMP_SIGNAL)
        traces = forensics.fr_dir(bundle)
        deadline = time.monotonic() + 60  # a few milliseconds each, on a loaded machine
        while time.monotonic() < deadline and len(list(traces.glob("rank_*"))) < 3:
            assert all(p.poll() is None for p in procs), "a rank died of the signal"
            time.sleep(0.2)
        yield traces
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_each_rank_writes_its_flight_recorder_trace_on_the_watchdogs_signal(fr_traces):
    from launcher.rank import flight_recorder

    dumps = flight_recorder.read(fr_traces)
    assert sorted(dumps) == [0, 1, 2] and not list(fr_traces.glob(".*"))  # whole files, no temporary left
    assert dumps[0]["pg_config"]["0"]["ranks"] == "[0, 1, 2]"  # gloo registers no members: the rank fills them
    last = dumps[0]["entries"][-1]
    assert (last["profiling_name"], last["collective_seq_id"], last["retired"]) == ("gloo:all_reduce", 4, False)


def test_the_flight_recorder_names_the_rank_that_never_entered_and_torch_agrees(fr_traces):
    from launcher.rank import flight_recorder

    fr = flight_recorder.analyse(flight_recorder.read(fr_traces), asked=set())
    assert {k: fr[k] for k in ("rank", "trace", "op", "seq", "group", "waiting")} == \
        {"rank": 1, "trace": True, "op": "all_reduce", "seq": 4, "group": [0, 1, 2], "waiting": 2}, fr
    assert ("all_reduce", 4, [0, 1, 2], [1]) in flight_recorder.torch_missing(fr_traces)
    states = [_state(r, 3, {}, None, coords={"pp": 0, "dp": r, "tp": 0, "cp": 0, "pp_size": 1, "dp_size": 3,
                                             "dp_group": [0, 1, 2]}) for r in range(3)]
    found, rank, source = watchdog.fr_verdict(fr_traces, states, set(), {})
    assert (found, rank) == ("rank 1 (host h, pipeline stage 0, data-parallel rank 1 of group [0-1-2]) never entered "
                             "all_reduce #4 of group [0-1-2] that 2 ranks are waiting in", 1)
    assert source == "the Flight Recorder by torch's fr_trace analysis"


def test_a_silent_rank_without_a_trace_is_named_from_the_traces_present(fr_traces, tmp_path):
    """The stopped rank writes no trace; torch's analysis cannot name it (it reports missing ranks only among the
    dumps), the traces present do: the others wait in #4 of a group it belongs to."""
    from launcher.rank import flight_recorder

    for r in (0, 2):
        shutil.copy(fr_traces / f"rank_{r}", tmp_path / f"rank_{r}")
    assert flight_recorder.analyse(flight_recorder.read(tmp_path), asked=set()) is None  # not asked: not blamed
    states = [_state(r, 3, {"0-1-2": [4 if r != 1 else 3, "all_reduce", "in" if r != 1 else "out"]},
                     "0-1-2" if r != 1 else None) for r in range(3)]
    found, rank, source = watchdog.fr_verdict(tmp_path, states, {1}, {1: "T"})
    assert rank == 1 and source == "the Flight Recorder traces of ranks 0, 2", source
    assert found == ("rank 1 (host h, pipeline stage 0, data-parallel rank 0, tensor rank 1) never entered "
                     "all_reduce #4 of group [0-1-2] that 2 ranks are waiting in; it left no Flight Recorder trace "
                     "(process state T: stopped?)"), found
    assert flight_recorder.torch_missing(tmp_path) == []


def _entry(pg, seq, op="all_reduce", retired=True, p2p=False):
    return {"process_group": (pg, "undefined"), "collective_seq_id": seq, "profiling_name": f"gloo:{op}",
            "retired": retired, "is_p2p": p2p}


def _dump(groups, *entries):
    return {"version": "2.10", "pg_config": {k: {"name": k, "desc": "undefined", "ranks": str(v)}
                                             for k, v in groups.items()}, "entries": list(entries)}


def test_the_flight_recorder_parser_follows_the_rank_that_never_entered():
    """Synthetic traces: ranks 0 and 1 wait in all_reduce #7 of [0-1-2-3]; rank 2 never entered it, being inside
    all_gather #3 of [2-3], which rank 3 never entered (its last entry there is #2 and it waits on a p2p)."""
    from launcher.rank import flight_recorder

    world, tp = {"0": [0, 1, 2, 3]}, {"0": [0, 1, 2, 3], "5": [2, 3]}
    dumps = {0: _dump(world, _entry("0", 6), _entry("0", 7, retired=False)),
             1: _dump(world, _entry("0", 7, retired=False)),
             2: _dump(tp, _entry("0", 6), _entry("5", 3, "all_gather", retired=False)),
             3: _dump(tp, _entry("5", 2, "all_gather"), _entry("0", 7, retired=True),
                      _entry("0", 0, "send", retired=False, p2p=True))}
    fr = flight_recorder.analyse(dumps, asked=set())
    assert (fr["rank"], fr["op"], fr["seq"], fr["group"], fr["waiting"]) == (3, "all_gather", 3, [2, 3], 1), fr
    del dumps[3]  # rank 3 silent, no trace: it is the one, in the group rank 2 waits in
    assert flight_recorder.analyse(dumps, asked={3})["rank"] == 3
    assert flight_recorder.analyse(dumps, asked=set())["rank"] == 2  # not asked (another node): the chain's end
    dumps[3] = _dump(tp, _entry("5", 2, "all_gather"), _entry("0", 6), _entry("0", 7, retired=False))
    dumps[2]["entries"][0] = _entry("0", 6)
    assert flight_recorder.analyse(dumps, asked=set()) is None  # 2 waits for 3 in [2-3], 3 for 2 in #7: a cycle
