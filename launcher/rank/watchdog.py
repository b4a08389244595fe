"""The node's hang watchdog: outside the training processes, it notices that no collective has moved for
``timeouts.hang_s`` (launcher/core/timeouts.py), dumps every rank's stacks, names the rank that hangs the others,
and stops the run with that one line, before the process group's timeout would abort every rank with the same
"watchdog caught collective operation timeout" that names nobody.

It runs as a thread of ``launcher.rank.agent`` (torchrun's process on each node), reading the state files the
ranks keep (``launcher.rank.forensics``: per process group, the number of each rank's last collective and whether
it is inside it). Armed once a step has completed (before that, the first step's allowance is the process group's
timeout: checkpoint load, data index build, compile). The line::

    hang at step 812: rank 37 (host gpu-0153, pipeline stage 4, data-parallel rank 3) never entered all_reduce #20311
    of group [5-37-69-101] that 3 ranks are waiting in; stacks: BUNDLE/hang-812/

or, where the rank did enter it but stopped answering (SIGSTOP, stuck in the kernel, gone), "stopped responding
inside". The same request makes every answering rank write its Flight Recorder trace (launcher/rank/
flight_recorder.py); where those traces name the rank (torch's ``fr_trace`` analysis, or the traces present: a
member of the waited-in collective's group that left none or never entered it), the line is theirs, else the
counters'; it says which (``named from ...``). Evidence in ``BUNDLE/hang-STEP/``: every answering rank's stacks
(all threads) and Flight Recorder trace (``fr/rank_N``), every rank's state, the analysis (``report.json``); the
line also goes to ``BUNDLE/FAILED`` (launch.sh's last line, and no restart or requeue retries a hang). Files,
/proc and signals; torch only for its own Flight Recorder analysis (the agent has it loaded).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Optional

from launcher.rank import flight_recorder, forensics

ANSWER_S = 5.0
"""How long the watchdog waits for the ranks' stack dumps after asking (faulthandler writes in milliseconds)."""
STOPPED_STATES = {"T", "t", "Z", "X", "D"}
"""/proc/PID/stat states of a rank that cannot make progress (stopped, traced, zombie, dead, uninterruptible)."""


def read_states(bundle: Path) -> list[dict]:
    """Every rank's state file (a torn read is retried; an unreadable one is skipped)."""
    out = []
    for path in sorted((Path(bundle) / forensics.DIR).glob("rank-*.json")):
        for _ in range(3):
            try:
                out.append(json.loads(path.read_bytes().strip() or b"null"))
                break
            except (OSError, ValueError):
                time.sleep(0.01)
    return [s for s in out if isinstance(s, dict)]


def proc_state(pid: int) -> Optional[str]:
    """The process's state letter (R, S, D, T, Z, ...), or None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _local(states: list[dict], host: str) -> list[dict]:
    return [s for s in states if s.get("host") == host and proc_state(int(s.get("pid", 0))) is not None]


def _fingerprint(states: list[dict]) -> tuple:
    return tuple((s["rank"], s["pid"], s.get("step"), s.get("current"),
                  tuple(sorted((k, tuple(v)) for k, v in s.get("groups", {}).items()))) for s in states)


class Watchdog(threading.Thread):
    """Polls the local ranks' states; after ``hang_s`` without change (once a step completed) investigates once,
    calls ``on_hang(line)`` and ends."""

    def __init__(self, bundle: Path, hang_s: float, on_hang: Callable[[str], None], poll_s: Optional[float] = None,
                 host: Optional[str] = None, clock=time.monotonic):
        super().__init__(name="launcher-hang-watchdog", daemon=True)
        self.bundle, self.hang_s, self.on_hang = Path(bundle), float(hang_s), on_hang
        self.poll_s = poll_s or min(5.0, max(0.5, self.hang_s / 10))
        self.host, self.clock = host or socket.gethostname(), clock
        self.done = threading.Event()
        self.line: Optional[str] = None
        self.culprit: Optional[dict] = None  # {"rank", "host"} of the rank named, where one is

    def run(self) -> None:
        last, since = None, self.clock()
        while not self.done.wait(self.poll_s):
            states = _local(read_states(self.bundle), self.host)
            fingerprint = _fingerprint(states)
            if not states or max(s.get("step") or 0 for s in states) < 1 or fingerprint != last:
                last, since = fingerprint, self.clock()  # nothing to watch yet, not armed, or progress
                continue
            if self.clock() - since >= self.hang_s:
                self.line, self.culprit = investigate(self.bundle, self.host, self.clock() - since)
                self.on_hang(self.line)
                return

    def stop(self) -> None:
        self.done.set()


def investigate(bundle: Path, host: str, quiet_s: float) -> tuple:
    """Dump every local rank's stacks, read every state, name the culprit; write BUNDLE/hang-STEP/; (the line, the
    culprit's {"rank", "host"} or None)."""
    states = read_states(bundle)
    step = max((s.get("step") or 0 for s in states), default=0)
    out = bundle / f"hang-{step}"
    n = 1
    while out.exists():
        n += 1
        out = bundle / f"hang-{step}-{n}"
    out.mkdir(parents=True)
    local = _local(states, host)
    before = {s["rank"]: _size(forensics.stacks_path(bundle, s["rank"])) for s in local}
    traces = forensics.fr_dir(bundle)
    fr_before = {s["rank"]: _mtime(traces / f"{flight_recorder.PREFIX}{s['rank']}") for s in local if s.get("fr")}
    for s in local:
        try:
            os.kill(int(s["pid"]), forensics.DUMP_SIGNAL)
        except OSError:
            pass
    deadline = time.monotonic() + ANSWER_S
    answered: set = set()
    traced: set = set()
    while time.monotonic() < deadline and (len(answered) < len(local) or not answered & set(fr_before) <= traced):
        time.sleep(0.2)
        answered = {r for r in before if _size(forensics.stacks_path(bundle, r)) > before[r]}
        traced = {r for r in fr_before if _mtime(traces / f"{flight_recorder.PREFIX}{r}") != fr_before[r]}
    for rank in sorted(answered):
        with open(forensics.stacks_path(bundle, rank), "rb") as f:
            f.seek(before[rank])
            (out / f"stacks-rank-{rank}.txt").write_bytes(f.read())
    for rank in sorted(traced):  # whole, as the rank wrote it (tmp, then rename)
        name = f"{flight_recorder.PREFIX}{rank}"
        (out / flight_recorder.DIR).mkdir(exist_ok=True)
        tmp = out / flight_recorder.DIR / f".{name}.tmp"
        tmp.write_bytes((traces / name).read_bytes())
        os.replace(tmp, out / flight_recorder.DIR / name)
    procs = {s["rank"]: proc_state(int(s["pid"])) for s in local}
    silent = {s["rank"] for s in local if s["rank"] not in answered or procs[s["rank"]] in STOPPED_STATES}
    found, rank = verdict(states, silent, procs)
    source = "the launcher's collective counters"
    fr = fr_verdict(out / flight_recorder.DIR, states, silent, procs) if traced else None
    if fr is not None:
        found, rank, source = fr
    line = (f"hang at step {step}: {found} (no collective progress for {quiet_s:.0f} s; named from {source}); "
            f"stacks: {out}/")
    own = next((s for s in states if s.get("rank") == rank), None) if rank is not None else None
    culprit = {"rank": rank, "host": own.get("host")} if own is not None else None
    report = {"line": line, "step": step, "host": host, "quiet_s": round(quiet_s, 1), "answered": sorted(answered),
              "silent": sorted(silent), "process_states": procs, "culprit": culprit, "source": source,
              "flight_recorder_traces": sorted(traced), "states": states}
    tmp = out / ".report.json.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out / "report.json")
    return line, culprit


def fr_verdict(directory: Path, states: list[dict], silent: set, proc_states: dict) -> Optional[tuple]:
    """(found, the culprit rank, source) from the Flight Recorder traces in ``directory``, or None where they name
    no rank (then the counters' verdict stands). Only a rank that did not answer at all is blamed for having no
    trace (one that answered with its stacks but no trace, e.g. a rank of an older launcher, is no evidence)."""
    try:
        fr = flight_recorder.analyse(flight_recorder.read(directory), silent)
    except Exception:  # noqa: BLE001 - a trace torch changed the shape of: the counters still speak
        return None
    # A live rank named while another does not answer: that one is the likelier cause, reached through a p2p wait
    # the Flight Recorder's collective order cannot follow; the counters' verdict prefers the silent rank
    if fr is None or (fr["trace"] and silent):
        return None
    r, by_rank = fr["rank"], {s["rank"]: s for s in states}
    key = "-".join(map(str, fr["group"]))
    n = fr["waiting"]
    what = (f"{fr['op']} #{fr['seq']} of group [{key}] that {n} rank{'s' if n != 1 else ''} "
            f"{'are' if n != 1 else 'is'} waiting in")
    source = f"the Flight Recorder traces of ranks {', '.join(map(str, fr['traced']))}"
    if fr["trace"]:
        found = f"{_who(by_rank.get(r), r)} never entered {what}"
        missing = flight_recorder.torch_missing(directory) or []
        if any(op == fr["op"] and seq == fr["seq"] and r in gone for op, seq, _, gone in missing):
            source = "the Flight Recorder by torch's fr_trace analysis"  # utils.py error_analysis: "missing ranks"
        return found, r, source
    own = by_rank.get(r) or {}
    counted = (own.get("groups") or {}).get(key)
    if counted and counted[2] == "in":
        verb = "stopped responding inside"
    elif counted:
        verb = "never entered"
    else:
        verb = "did not answer in"
    state = proc_states.get(r)
    return (f"{_who(by_rank.get(r), r)} {verb} {what}; it left no Flight Recorder trace (process state "
            f"{state or 'gone'}{': stopped?' if state in STOPPED_STATES else ''})", r, source)


def _mtime(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _who(s: Optional[dict], rank: int) -> str:
    if s is None:
        return f"rank {rank} (no state: another node's file not visible here)"
    c = s.get("coords") or {}
    where = [f"host {s.get('host')}"]
    if c:
        dp_group = f" of group [{'-'.join(map(str, c['dp_group']))}]" if c.get("dp_group") else ""
        where += [f"pipeline stage {c['pp']}", f"data-parallel rank {c['dp']}{dp_group}"]
        if c.get("tp"):
            where.append(f"tensor rank {c['tp']}")
    return f"rank {rank} ({', '.join(where)})"


def _inside(s: dict) -> Optional[tuple]:
    """(group, number, op) of the collective the rank is inside, or None."""
    key = s.get("current")
    if key and key in s.get("groups", {}):
        seq, op, _ = s["groups"][key]
        return key, seq, op
    return None


def _behind(by_rank: dict, key: str, seq: int) -> list:
    """Members of group ``key`` whose count on it is below ``seq``: they never entered that collective."""
    members = [int(r) for r in key.split("-") if r.isdigit()]
    return [r for r in members if r in by_rank and by_rank[r].get("groups", {}).get(key, [0])[0] < seq]


def analyse(states: list[dict], silent: set, proc_states: Optional[dict] = None) -> str:
    """The line of ``verdict``."""
    return verdict(states, silent, proc_states)[0]


def verdict(states: list[dict], silent: set, proc_states: Optional[dict] = None) -> tuple:
    """(line, the culprit rank or None where no one rank is it). Who hangs the others. Start at the collective most ranks are inside; a member that never entered it (its count
    on that group is behind) is followed into the collective it is inside itself, until a rank that is in none. A
    rank that does not answer (stopped, in the kernel, gone) is the culprit where the chain ends elsewhere (a p2p
    wait is not counted: the chain cannot follow it); else the chain's end is."""
    by_rank = {s["rank"]: s for s in states}
    proc_states = proc_states or {}
    inside = Counter(_inside(s) for s in states if _inside(s))
    if not inside:
        quiet = sorted(silent) or sorted(by_rank)
        return (f"no rank is inside a collective; {_who(by_rank.get(quiet[0]), quiet[0])} "
                f"{'stopped answering' if silent else 'is the first to look at'}", quiet[0] if silent else None)
    (key, seq, op), waiting = inside.most_common(1)[0]
    what = (f"{op} #{seq} of group [{key}] that {waiting} rank{'s' if waiting != 1 else ''} "
            f"{'are' if waiting != 1 else 'is'} waiting in")
    first = None
    chain, seen = [], set()
    here = (key, seq, op)
    while here is not None:
        behind = _behind(by_rank, here[0], here[1])
        if not behind:
            break
        r = sorted(behind, key=lambda x: (x not in silent, x))[0]
        if r in seen:  # back to a rank of the chain: they called their collectives in different orders
            loop = chain[[c[0] for c in chain].index(r):] + [(r, here)]
            parts = [f"rank {a} is inside {w[2]} #{w[1]} of group [{w[0]}], which rank {b} never entered"
                     for (a, _), (b, w) in zip(loop[:-1], loop[1:])]
            return (f"ranks {', '.join(str(c[0]) for c in loop[:-1])} wait on each other (collectives called in "
                    f"different orders): " + "; ".join(parts), None)
        seen.add(r)
        chain.append((r, here))
        first = first or r
        here = _inside(by_rank[r])
    if chain:
        end, (k, q, o) = chain[-1]
        own = by_rank[end]
        own_inside = _inside(own)
        elsewhere = (f"; it is inside {own_inside[2]} #{own_inside[1]} of group [{own_inside[0]}]" if own_inside
                     else "; it is inside no collective (a p2p wait or compute: see its stack)")
        if end in silent or not silent:
            state = f" and does not answer (process state {proc_states.get(end) or 'gone'}: stopped?)" if end in silent \
                else ""
            via = f" (reached from {what})" if (k, q, o) != (key, seq, op) else ""
            return (f"{_who(own, end)} never entered {o} #{q} of group [{k}]"
                    f"{' that ' + what.split(' that ', 1)[1] if (k, q, o) == (key, seq, op) else ''}{via}"
                    f"{elsewhere if end not in silent else ''}{state}", end)
    if silent:  # the chain ends at a rank that answers (its wait is p2p, not counted), or no one is behind
        r = sorted(silent)[0]
        own = by_rank.get(r)
        pos = _inside(own) if own else None
        where = f" inside {pos[2]} #{pos[1]} of group [{pos[0]}]" if pos else ""
        return (f"{_who(own, r)} stopped responding{where} (process state {proc_states.get(r) or 'gone'}); "
                f"{waiting} rank{'s' if waiting != 1 else ''} wait in {op} #{seq} of group [{key}]"
                + (f", which rank {first} never entered" if first is not None else ""), r)
    return f"every member of group [{key}] is inside {op} #{seq} ({waiting} ranks); none is behind or silent", None


HANG_NODE = "HANG_NODE"
"""BUNDLE/HANG_NODE: the host of the rank a hang was blamed on (one line), for job.sbatch's slurm.on_hang=exclude."""


def record_culprit_node(bundle: Path, culprit: Optional[dict]) -> None:
    """The culprit's host into BUNDLE/HANG_NODE, whole and only where no node wrote one first (every node's watchdog
    may investigate the same hang)."""
    if not culprit or not culprit.get("host"):
        return
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=".HANG_NODE.", dir=bundle)
    with os.fdopen(fd, "w") as f:
        f.write(str(culprit["host"]) + "\n")
    try:
        os.link(tmp, Path(bundle) / HANG_NODE)
    except FileExistsError:
        pass
    finally:
        os.unlink(tmp)


def kill_local(states: list[dict], host: str) -> None:
    """SIGKILL the local ranks (a stopped one too); torchrun then sees them fail and, with FAILED written, no
    restart tries again."""
    for s in _local(states, host):
        try:
            os.kill(int(s["pid"]), signal.SIGKILL)
        except OSError:
            pass
