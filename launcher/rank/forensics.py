"""Hang forensics, rank side: each rank's position in every collective, and its stacks on demand.

When a collective never completes, every rank dies on the same process-group timeout and nobody knows which rank
stopped first. Two things make the hung rank nameable from outside the training processes (the node's watchdog,
:mod:`launcher.rank.watchdog`, run by ``launcher.rank.agent``):

* **Collective sequence numbers** (gloo / CPU, where nothing dumps PyTorch's Flight Recorder on its own): every
  ``torch.distributed`` collective and blocking p2p call this rank makes is counted per process group, and the rank
  keeps, in a small state file ``BUNDLE/forensics/rank-N.json`` rewritten in place, for each group the number of its
  last collective, its name and whether the rank is inside it, plus its pipeline stage, data-parallel rank and last
  completed step. A rank blocked in all_reduce #812 of a group says so; a rank that never entered it shows #811.
  The Flight Recorder (``TORCH_FR_BUFFER_SIZE``, rendered by env.sh) records the same in C++, gloo's too, and is
  asked for below; these counters name the rank where its traces cannot (every waiter in a p2p op). On NCCL it
  also dumps itself on a timeout; there these wrappers are not installed.
* **Stacks on demand**: ``faulthandler`` registered on ``SIGUSR2`` writes every thread's Python stack into
  ``BUNDLE/forensics/stacks-rank-N.txt``; it runs at the C level, so a rank blocked inside a collective still
  answers. A rank that does not answer is stopped (SIGSTOP), in the kernel, or gone: that is evidence too.
* **Flight Recorder trace on the same request**: faulthandler chains to Python's C-level handler, which writes the
  signal's number to the rank's wake-up socket (launcher/rank/signals.py); its watcher thread writes this rank's
  Flight Recorder trace to ``BUNDLE/forensics/fr/rank_N`` (launcher/rank/flight_recorder.py). On gloo nothing
  else dumps it; a stopped rank writes none.

The wrappers must be installed before Megatron-Core is imported (it looks the functions up on ``torch.distributed``
at call time; code that imported a name earlier keeps the original).
"""
from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Optional

DIR = "forensics"
DUMP_SIGNAL = signal.SIGUSR2
"""Asks a rank for every thread's stack (SIGUSR1 is Slurm's stop signal: launcher.rank.signals)."""
STATE_BYTES = 16384
"""The state file's fixed size: rewritten in place (one pwrite), padded with spaces."""
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "_all_gather_base", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "barrier", "monitored_barrier",
               "all_to_all", "all_to_all_single", "reduce", "gather", "scatter", "all_gather_object",
               "broadcast_object_list", "gather_object", "scatter_object_list", "all_reduce_coalesced",
               "all_gather_coalesced", "send", "recv")
"""The torch.distributed calls counted: every collective, and the blocking p2p ops."""


def state_path(bundle: Path, rank: int) -> Path:
    return Path(bundle) / DIR / f"rank-{rank}.json"


def stacks_path(bundle: Path, rank: int) -> Path:
    return Path(bundle) / DIR / f"stacks-rank-{rank}.txt"


class Recorder:
    """This rank's state file: identity, coordinates, step, and per process group its last collective."""

    def __init__(self, bundle: Path, rank: int):
        self.path = state_path(bundle, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.state = {"rank": rank, "pid": os.getpid(), "host": socket.gethostname(), "coords": None, "step": 0,
                      "groups": {}, "current": None}
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._keys: dict = {}
        self.write()

    def write(self) -> None:
        data = json.dumps(self.state, separators=(",", ":")).encode()
        if len(data) > STATE_BYTES:  # more groups than fit: keep the current one and the newest
            keep = dict(list(self.state["groups"].items())[-32:])
            data = json.dumps(dict(self.state, groups=keep), separators=(",", ":")).encode()[:STATE_BYTES]
        os.pwrite(self.fd, data.ljust(STATE_BYTES), 0)

    def group_key(self, group) -> str:
        key = self._keys.get(id(group))
        if key is None:
            import torch.distributed as dist

            try:
                ranks = dist.get_process_group_ranks(group) if group is not None else range(dist.get_world_size())
            except Exception:  # noqa: BLE001 - a group this rank is not in, or before init: still counted
                ranks = ()
            key = "-".join(map(str, ranks)) or "?"
            self._keys[id(group)] = key
        return key

    def enter(self, op: str, group) -> tuple:
        key = self.group_key(group)
        seq = self.state["groups"].get(key, [0])[0] + 1
        self.state["groups"][key] = [seq, op, "in"]
        self.state["current"] = key
        self.write()
        return key, seq

    def leave(self, key: str, seq: int, op: str) -> None:
        self.state["groups"][key] = [seq, op, "out"]
        self.state["current"] = None
        self.write()

    def set(self, **values) -> None:
        self.state.update(values)
        self.write()


RECORDER: list = [None]
"""This process's :class:`Recorder` once :func:`install` ran (None: not installed)."""


def install(bundle: Path, rank: int, *, count_collectives: bool) -> Recorder:
    """Stacks on SIGUSR2 into the bundle; with ``count_collectives`` (gloo: no Flight Recorder) every collective
    counted per group. Call before Megatron-Core is imported."""
    rec = Recorder(bundle, rank)
    RECORDER[0] = rec
    stacks = open(stacks_path(bundle, rank), "a")  # kept open for the process's life: faulthandler writes to its fd
    # Python's handler first: faulthandler's chain restores the previous handler and raises the signal again
    # (CPython Modules/faulthandler.c faulthandler_user), which for SIG_DFL would end the process. Python's C-level
    # handler then writes the number to the wake-up socket, where the watcher thread dumps the Flight Recorder.
    signal.signal(DUMP_SIGNAL, _noted)
    faulthandler.register(DUMP_SIGNAL, file=stacks, all_threads=True, chain=True)
    from launcher.rank import signals

    signals.STATE.also(DUMP_SIGNAL, lambda: dump_flight_recorder(bundle, rank))
    rec.set(fr=signals.STATE.installed)  # the watchdog waits for a trace only from a rank that will write one
    if count_collectives:
        _wrap_collectives(rec)
    return rec


def fr_dir(bundle: Path) -> Path:
    """Where each rank writes its Flight Recorder trace when asked (the watchdog copies the fresh ones)."""
    from launcher.rank import flight_recorder

    return Path(bundle) / DIR / flight_recorder.DIR


def dump_flight_recorder(bundle: Path, rank: int) -> None:
    """This rank's Flight Recorder trace into ``fr_dir`` (one line on stderr where it cannot)."""
    from launcher.rank import flight_recorder

    try:
        flight_recorder.dump(fr_dir(bundle), rank)
    except Exception as exc:  # noqa: BLE001 - evidence is best effort; the rank goes on either way
        print(f"rank {rank}: no Flight Recorder trace for the hang watchdog: {type(exc).__name__}: {exc}",
              file=sys.stderr, flush=True)


def _noted(signum, frame) -> None:
    """The Python-level handler of DUMP_SIGNAL: nothing (faulthandler wrote the stacks; the watcher thread dumps
    the Flight Recorder)."""


def _wrap_collectives(rec: Recorder) -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "_forensics", False):
            continue
        wrapped = _counted(rec, name, original)
        setattr(dist, name, wrapped)
        if getattr(c10d, name, None) is original:
            setattr(c10d, name, wrapped)


_DEPTH = threading.local()
"""Collectives called inside a counted one (all_gather_object's all_gather) are part of it, not counted again."""


def _counted(rec: Recorder, name: str, original):
    @functools.wraps(original)
    def call(*args, **kwargs):
        if getattr(_DEPTH, "n", 0):
            return original(*args, **kwargs)
        group = kwargs.get("group")
        if group is None:  # positional: the group's place differs per op; find the ProcessGroup among the args
            group = next((a for a in args if type(a).__name__ == "ProcessGroup"), None)
        key, seq = rec.enter(name, group)
        _DEPTH.n = 1
        try:
            return original(*args, **kwargs)
        finally:
            _DEPTH.n = 0
            rec.leave(key, seq, name)

    call._forensics = True
    return call


def set_coords(*, pp: int, dp: int, tp: int, cp: int, pp_size: int, dp_size: int,
               dp_group: Optional[list] = None) -> None:
    """This rank's place in the layout (after parallel_state is initialised), for the watchdog's line;
    ``dp_group``: the global ranks of its data-parallel group (the replicas a hang there stalls together)."""
    if RECORDER[0] is not None:
        coords = {"pp": pp, "dp": dp, "tp": tp, "cp": cp, "pp_size": pp_size, "dp_size": dp_size}
        if dp_group is not None:
            coords["dp_group"] = [int(r) for r in dp_group]
        RECORDER[0].set(coords=coords)


def set_step(step: int) -> None:
    """The last completed step (the watchdog arms once one has completed)."""
    rec: Optional[Recorder] = RECORDER[0]
    if rec is not None:
        rec.set(step=int(step))
