"""Signals that ask a rank to checkpoint and stop: SIGUSR1 (Slurm's early warning), SIGTERM (``scancel``,
preemption, torchrun passing on its own SIGTERM), SIGINT (Ctrl-C, passed on by torchrun) and SIGHUP.

Each one makes the step loop stop at the next step boundary, every rank at the same step (the loop's per-step
reduction), and save a checkpoint; a saved run loses nothing. SIGTERM is what Slurm sends first, ``KillWait``
seconds (30 by default) before SIGKILL; torchrun waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` s for its ranks after passing a
signal on (launch.sh: the signal lead, at least 300 s; launcher/core/signal_lead.py ``shutdown_timeout_s``).

Seen even while the main thread is blocked in a collective: Python's C-level handler writes the signal's number
to a wake-up socket (``signal.set_wakeup_fd``) at once, and a watcher thread reads it there; a Python handler
alone would run only once the blocking call returned. So a rank that cannot reach a step boundary (a peer died
in the middle of a collective: torchrun tears the others down with SIGTERM) does not wait for the boundary:
SIGTERM/SIGINT/SIGHUP start a grace timer (three of its recent steps, at least ``MIN_GRACE_S``); if no step
boundary is reached in time the rank exits with 128 + the signal, without a checkpoint, as the default action
would have. SIGUSR1 starts none: it comes ``slurm.signal_lead_s`` before the end.
"""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
from typing import Optional

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
MIN_GRACE_S = 15.0
_NAMES = {signal.SIGINT: "SIGINT (Ctrl-C)"}


def reason(sig: signal.Signals) -> str:
    """How a stop signal is named as a run's stop reason."""
    return _NAMES.get(sig, sig.name)


class StopSignals:
    """The process's stop request (one per rank process; ``install`` from the main thread)."""

    def __init__(self):
        self.requested: Optional[str] = None
        self.step_s = 0.0
        self._boundary = False
        self._timer: Optional[threading.Timer] = None
        self._installed = False
        self._lock = threading.Lock()
        self._also: dict = {}

    @property
    def installed(self) -> bool:
        """Whether the wake-up socket's watcher runs (``also`` actions need it)."""
        return self._installed

    def also(self, sig: signal.Signals, action) -> None:
        """Run ``action()`` on the watcher thread whenever ``sig`` arrives (its Python handler must be set, so that
        the C-level handler writes its number to the wake-up socket): launcher/rank/forensics.py's Flight Recorder
        dump on the hang watchdog's SIGUSR2, which a blocked main thread could not run."""
        self._also[int(sig)] = action

    def install(self) -> None:
        if self._installed or threading.current_thread() is not threading.main_thread():
            return
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        self._sockets = (reader, writer)  # kept alive for the process's life
        signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)
        for sig in STOP_SIGNALS:
            signal.signal(sig, _noted)
        threading.Thread(target=self._watch, args=(reader,), name="stop-signals", daemon=True).start()
        self._installed = True

    def _watch(self, reader) -> None:
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for number in data:
                if number in {int(s) for s in STOP_SIGNALS}:
                    self.deliver(signal.Signals(number))
                elif number in self._also:
                    self._also[number]()

    def deliver(self, sig: signal.Signals) -> None:
        """A stop signal arrived (called by the watcher thread; tests call it directly)."""
        with self._lock:
            if self.requested is None:
                self.requested = reason(sig)
            if sig != signal.SIGUSR1 and self._timer is None and not self._boundary:
                self._timer = threading.Timer(self.grace_s(), self._give_up, args=(sig,))
                self._timer.daemon = True
                self._timer.start()

    def grace_s(self) -> float:
        return max(MIN_GRACE_S, 3 * self.step_s)

    def at_boundary(self) -> None:
        """The loop stopped at a step boundary: the checkpoint follows, however long it takes."""
        with self._lock:
            self._boundary = True
            if self._timer is not None:
                self._timer.cancel()

    def _give_up(self, sig: signal.Signals) -> None:
        if self._boundary:
            return
        sys.stderr.write(f"rank {os.environ.get('RANK', '?')}: {reason(sig)} and no step boundary "
                         f"within {self.grace_s():.0f} s (blocked in a collective, or still starting): exiting "
                         "without a checkpoint\n")
        sys.stderr.flush()
        os._exit(128 + int(sig))


def helper_ignores_stop_signals() -> None:
    """Initializer of a rank's helper process (the checkpoint writers' results queue: ``writer_results_queue``):
    a stop signal is for the rank, which saves a checkpoint after it and needs the helper for that (scancel
    signals every process of the step); the helper ends with the rank instead (Linux PR_SET_PDEATHSIG), also when
    the rank is SIGKILLed."""
    import ctypes

    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG = 1
    except (OSError, AttributeError):
        pass


_HELPERS: list = []
"""The results queue's manager (kept referenced for the process's life)."""


def writer_results_queue() -> None:
    """Start the queue through which Megatron-Core's checkpoint writers report their results
    (dist_checkpointing/strategies/filesystem_async.py ``get_write_results_queue``: a ``Manager().Queue()``, i.e. a
    server process, made once per rank at its first save) with a server that survives stop signals. Megatron's own
    dies of SIGTERM: after a save, a scancel or preemption that signals every process killed it, and the stop save
    (or the asynchronous save in flight) then failed with "ConnectionRefusedError" (measured: async save, SIGTERM
    to every rank process). Idempotent."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:
        return
    import multiprocessing
    from multiprocessing.managers import SyncManager

    manager = SyncManager(ctx=multiprocessing.get_context("spawn"))  # Megatron's context for it
    manager.start(initializer=helper_ignores_stop_signals)
    _HELPERS.append(manager)
    filesystem_async._results_queue = PickledQueue(manager.Queue())


class PickledQueue:
    """The writers' results queue as Megatron-Core uses it (filesystem_async.py: ``put`` of the write results or
    an exception, ``get_nowait`` in ``retrieve_write_results``), holding pickled bytes. A manager's server unpickles
    what it stores, and the write results are torch.distributed.checkpoint objects: Megatron's plain queue made
    every rank's helper process import torch at the first save (measured: ~4 CPU s each, libtorch mapped in
    every helper of every rank). The helper now holds bytes and imports nothing; the rank unpickles them.
    Picklable as the proxy it wraps is (an asynchronous save hands it to its writer process)."""

    def __init__(self, proxy):
        self._proxy = proxy

    def put(self, item, *args, **kwargs) -> None:
        import pickle

        self._proxy.put(pickle.dumps(item), *args, **kwargs)

    def get(self, *args, **kwargs):
        import pickle

        return pickle.loads(self._proxy.get(*args, **kwargs))

    def get_nowait(self):
        import pickle

        return pickle.loads(self._proxy.get_nowait())

    def empty(self) -> bool:
        return self._proxy.empty()

    def qsize(self) -> int:
        return self._proxy.qsize()


def _noted(signum, frame) -> None:
    """The Python-level handler: nothing (the watcher thread has the signal from the wake-up socket)."""


STATE = StopSignals()
