"""Signals (issue 27 item 6): Ctrl-C and SIGTERM (scancel, preemption) checkpoint at the next step boundary and
end with the shell's exit code (130, 143) and one final line, no traceback; a rank that cannot reach a boundary
(blocked in a collective whose peer died) still exits soon after SIGTERM, as torchrun's teardown expects."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

from _rank_harness import ROOT, TINY, layout
from launcher.executor import bundle_processes

ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore")


def test_stop_signals_request_a_stop_and_a_boundary_cancels_the_grace_timer():
    from launcher.rank.signals import StopSignals

    state = StopSignals()
    state.deliver(signal.SIGUSR1)
    assert state.requested == "SIGUSR1" and state._timer is None  # the early warning starts no timer
    state.deliver(signal.SIGINT)
    assert state.requested == "SIGUSR1" and state._timer is not None  # the first reason stays
    state.at_boundary()
    assert not state._timer.is_alive() or state._timer.finished.is_set()
    state.step_s = 20.0
    assert state.grace_s() == 60.0


_AGREE_SCRIPT = r"""
import json, sys
sys.path.insert(0, sys.argv[1] + "/tests")
from _rendezvous import join
join(int(sys.argv[2]), int(sys.argv[3]), 2)
from megatron.core import parallel_state
parallel_state.initialize_model_parallel()
from launcher.rank.loop import STOP_REASONS, reduce_report
seen = []
for case in json.loads(sys.argv[4]):
    loss, code = reduce_report(2.0, case[int(sys.argv[3])])
    seen.append(None if code is None else STOP_REASONS[code])
print("SEEN", json.dumps(seen), flush=True)
"""


def test_every_rank_reports_the_stop_reason_the_ranks_agree_on():
    """scancel signals every process, but not at once: a rank whose SIGTERM lands after the step's reduction
    learns the cause there, and prints "SIGTERM", not "another rank asked to stop" (make test at e390203: rank 0's
    line said the latter and test_sigterm_to_every_process... failed). Two ranks, gloo, the loop's reduction."""
    from _rendezvous import host

    guard = "the Slurm time limit is 40 s away, less than 2 x the last save (9.0 s) + a step (1.0 s) + 5 s"
    cases = [[None, None], [None, "SIGTERM"], ["STOP file", "SIGUSR1"], [guard, None], ["SIGINT (Ctrl-C)", "odd"]]
    store = host(2)
    procs = [subprocess.Popen([sys.executable, "-c", _AGREE_SCRIPT, str(ROOT), str(store.port), str(rank),
                               json.dumps(cases)], env=dict(ENV, PYTHONPATH=str(ROOT)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    seen = [json.loads(next(x for x in out.splitlines() if x.startswith("SEEN"))[5:]) for out, _ in outs]
    assert seen[0] == seen[1] == [None, "SIGTERM", "SIGUSR1", "the Slurm time limit is near", "SIGINT (Ctrl-C)"]


def test_a_rank_blocked_in_native_code_exits_143_after_the_grace():
    """The main thread blocks in a C call (a socket read, as a collective would): a Python signal handler would
    never run; the wake-up socket's watcher still sees SIGTERM and exits once the grace has passed."""
    script = textwrap.dedent("""
        import socket, sys
        from launcher.rank import signals
        signals.MIN_GRACE_S = 1.0
        signals.STATE.install()
        a, b = socket.socketpair()
        print("blocked", flush=True)
        a.recv(1)  # never returns
        print("unreachable", flush=True)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "blocked"
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143, (proc.returncode, out, err)
    assert "SIGTERM and no step boundary within 1 s" in err and "unreachable" not in out


def _scancel(signalled: list):
    """What scancel does to a job step: SIGTERM to every process of the bundle (torchrun, ranks, loader workers);
    the pids reached are appended to ``signalled``."""
    def scancel(bundle):
        for pid in bundle_processes(bundle):
            try:
                os.kill(pid, signal.SIGTERM)
                signalled.append(pid)
            except ProcessLookupError:
                pass
    return scancel


def _start(tmp_path, name):
    overrides = [*TINY, *layout(pp=2), "train.train_steps=2000", "checkpoint.save_interval=0", "data.num_workers=1"]
    cmd = [sys.executable, "-m", "launcher", *overrides, "cluster.gpus_per_node=2", f"output_dir={tmp_path}",
           f"name={name}", "action=run"]
    # not a new session: Ctrl-C reaches the launcher as from a terminal (launch.sh has a session of its own)
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _run_and_signal(proc, send, at_step: int = 3, timeout: float = 600, then=()):
    """Read the run's output; once step ``at_step`` is printed call ``send(bundle)``, then for each (pattern, send)
    of ``then`` in turn, once a later line matches the pattern; returns (rc, output)."""
    lines, triggers = [], [(rf"^step\s+{at_step} \|", send), *then]
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    try:
        for line in proc.stdout:
            lines.append(line)
            if triggers and re.search(triggers[0][0], line):
                bundle = next(x.split("bundle: ", 1)[1].strip() for x in lines if x.startswith("bundle: "))
                triggers.pop(0)[1](bundle)
        proc.wait()
    finally:
        killer.cancel()
    return proc.returncode, "".join(lines)


def _checkpointed_stop(out: str, bundle_dir, why: str) -> int:
    stopped = re.findall(rf"^launcher: stopped at step (\d+) of 2000: {re.escape(why)}; checkpointed", out,
                         re.MULTILINE)
    assert len(stopped) == 1, out[-4000:]
    step = int(stopped[0])
    assert (bundle_dir / "checkpoints" / f"iter_{step:07d}" / "launcher.json").is_file(), out[-3000:]
    assert "Traceback" not in out and "failed" not in out.replace("run finished", ""), out[-4000:]
    return step


def test_ctrl_c_checkpoints_at_the_next_step_and_exits_130(tmp_path):
    proc = _start(tmp_path, "ctrlc")
    code, out = _run_and_signal(proc, lambda bundle: proc.send_signal(signal.SIGINT))
    bundle_dir = next(tmp_path.glob("ctrlc-*"))
    assert code == 130, out[-4000:]
    _checkpointed_stop(out, bundle_dir, "SIGINT (Ctrl-C)")
    assert out.rstrip().splitlines()[-1] == f"run finished with exit code 130; bundle: {bundle_dir}"


def test_sigterm_to_every_process_as_scancel_sends_it_checkpoints_and_exits_143(tmp_path):
    """Slurm's scancel (and preemption) signals every process of the step: torchrun, each rank, their loader
    workers. KillWait (30 s) later comes SIGKILL; the stop checkpoint must be written before."""
    proc = _start(tmp_path, "term")
    signalled = []
    scancel = _scancel(signalled)

    code, out = _run_and_signal(proc, scancel)
    bundle_dir = next(tmp_path.glob("term-*"))
    assert len(signalled) >= 3, signalled  # torchrun and both ranks at least
    assert code == 143, out[-4000:]
    _checkpointed_stop(out, bundle_dir, "SIGTERM")


def test_sigterm_twice_still_checkpoints_and_exits_143(tmp_path):
    """An impatient second scancel: SIGTERM again to every process while torchrun waits for its ranks' stop
    checkpoint. torchrun's handler raised out of that wait, so it exited at once and the end of the job step
    killed the ranks in the middle of their save; the second signal must change nothing."""
    proc = _start(tmp_path, "term2")
    signalled = []
    scancel = _scancel(signalled)

    # torchrun logs "Sending process N closing signal SIGTERM" once it waits for its ranks: the second one then
    code, out = _run_and_signal(proc, scancel, then=[(r"closing signal SIGTERM", scancel)])
    bundle_dir = next(tmp_path.glob("term2-*"))
    assert len(signalled) >= 6, signalled  # twice: torchrun and both ranks at least
    assert code == 143, out[-4000:]
    _checkpointed_stop(out, bundle_dir, "SIGTERM")


def test_ctrl_c_while_torchrun_starts_is_130_without_a_traceback(monkeypatch, capsys):
    """Ctrl-C in the first seconds, while torchrun still imports and parses (before it installs its own
    handlers): a KeyboardInterrupt traceback and exit 1 (or death by SIGINT) before; now 130 and one line."""
    import torch.distributed.run as torchrun

    from launcher.rank import agent

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(torchrun, "parse_args", interrupted)
    assert agent.main(["--standalone", "--nproc-per-node=2", "-m", "launcher.rank", "--bundle", "/x"]) == 130
    assert capsys.readouterr().err == "torchrun: SIGINT received while starting; no rank was started\n"
