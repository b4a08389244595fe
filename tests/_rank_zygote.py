"""Test-only rank launcher: the ranks of a run are forked from a warm process that has imported torch,
Megatron-Core and the rank wing once, instead of started by torchrun as fresh interpreters.

Why: on this 2-core machine a fresh rank spends about 3 CPU s importing torch + Megatron-Core (and torchrun's agent
1.5 s more) before it runs a line of ours, so a 4-rank run of a few steps is mostly start-up; the suite starts
about a hundred such runs. Forked ranks start in milliseconds and run exactly the same code from
``launcher.rank.entry.main`` on: the same bundle, the same working directory, torchrun's environment variables
(RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_*; the leader hosts the rendezvous store, as
torchrun's agent does), stdout/stderr into the caller's pipes, and
torchrun's failure rule (one rank fails: the others get SIGTERM, the run exits 1).

What it does not do (those tests keep the real torchrun, ``_rank_harness.run_train`` decides): restarts
(``--max-restarts``), and any run whose environment differs from the session's in a variable
that may be read at import time (``_rank_harness.IMPORT_TIME_PREFIXES``: its value in the warm server would be
stale; the others are the run's own, os.environ is replaced in each rank). ``LAUNCHER_TEST_TORCHRUN=1`` sends every
run through torchrun.
The real launch path (``python -m launcher`` -> launch.sh -> ``launcher.rank.agent`` -> ranks) stays covered by
the tests that start it (tests/test_nothing_lost.py, the Slurm tests, ``make run``).

Protocol (one Unix socket): the client sends a JSON request with two file descriptors (stdout, stderr write ends,
SCM_RIGHTS); the server forks a leader, which puts itself in a new process group, answers ``{"pid": leader}``,
forks the ranks, and finally sends ``{"rc": code}``. The client closing the socket early kills the group.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time

WARM_MODULES = (
    "torch", "torch.distributed", "numpy", "megatron.core", "megatron.core.parallel_state",
    "megatron.core.tensor_parallel", "megatron.core.models.gpt", "megatron.core.pipeline_parallel",
    "megatron.core.distributed", "megatron.core.optimizer", "megatron.core.dist_checkpointing",
    "megatron.core.datasets.gpt_dataset", "megatron.core.datasets.blended_megatron_dataset_builder",
    "launcher.core", "launcher.core.flops", "launcher.rank.entry", "launcher.rank.checkpoint.store",
    "launcher.rank.data", "launcher.rank.loop", "launcher.rank.metrics", "launcher.rank.optim",
    "launcher.rank.setup", "launcher.rank.console", "launcher.rank.zb_executor", "models.backend",
    "models.builder", "models.cpu_compat", "torch.utils.tensorboard", "matplotlib", "matplotlib.pyplot",
    "torch._dynamo",  # imported by torch.optim.AdamW.__init__ (torch._compile): 1.7 CPU s per rank per run

)
"""Imported once by the server (what ``launcher.rank.entry.train`` imports); a missing one is skipped."""


def _warm() -> None:
    import importlib

    from models.lazy_compile import defer_torch_compile

    defer_torch_compile()  # as launcher/rank/__main__.py does, before Megatron-Core is imported
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    import matplotlib

    matplotlib.use("Agg")


def _rank_main(bundle: str, env: dict, script: str | None = None, argv: list | None = None) -> int:
    """In a forked rank: torchrun's environment, ``python -m launcher.rank``'s ``__main__``, then the entry (or
    a test's own worker script as ``__main__``, as ``torchrun SCRIPT ARGS`` runs it)."""
    import atexit
    import importlib
    import random
    import traceback

    import numpy

    os.environ.clear()
    os.environ.update(env)
    random.seed()  # a fresh interpreter seeds these from the OS; forked ones would all share the server's
    numpy.random.seed()
    try:
        if script is not None:
            import runpy

            sys.argv = [script, *(argv or [])]
            runpy.run_path(script, run_name="__main__")
            code = 0
        else:
            # the __main__ a torchrun rank has (multiprocessing's spawn re-imports it by name, as under torchrun)
            sys.modules["__main__"] = importlib.import_module("launcher.rank.__main__")
            sys.argv = [sys.modules["__main__"].__file__, "--bundle", bundle]
            from launcher.rank.entry import main

            code = main(["--bundle", bundle])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - as an uncaught exception in a fresh interpreter: traceback, exit 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # multiprocessing's (join/terminate its children), torch's, ours
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001
                pass
    return int(code or 0)


def _leader(conn: socket.socket, request: dict, out_fd: int, err_fd: int) -> None:
    """A forked leader: its own process group, one forked child per rank, torchrun's failure rule."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    os.dup2(out_fd, 1)  # the leader's own lines and every rank's output go to the client's pipes
    os.dup2(err_fd, 2)
    os.close(out_fd)
    os.close(err_fd)
    nproc = int(request["nproc"])
    conn.sendall(json.dumps({"pid": os.getpid()}).encode() + b"\n")
    # torchrun's agent store: the leader hosts the rendezvous TCPStore on a port the kernel picks when it binds,
    # and the ranks are its clients (TORCHELASTIC_USE_AGENT_STORE, as under torchrun's agent). A port found free
    # and handed to rank 0 to bind later can be taken in between by any other process's socket: EADDRINUSE
    # (suite_under_load at fe8e865, run 1). The ranks are forked first (no store thread yet) and wait for the port.
    base = dict(request["env"], MASTER_ADDR="127.0.0.1", WORLD_SIZE=str(nproc), TORCHELASTIC_USE_AGENT_STORE="True",
                LOCAL_WORLD_SIZE=str(nproc), GROUP_RANK="0", GROUP_WORLD_SIZE="1", ROLE_NAME="default",
                ROLE_WORLD_SIZE=str(nproc), TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                TORCHELASTIC_RUN_ID="zygote")
    ranks, port_pipes = {}, []
    for rank in range(nproc):
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:
            conn.close()
            for fd in port_pipes + [write_end]:  # EOF, not a hang, if the leader dies before it writes
                os.close(fd)
            port = os.read(read_end, 32).decode().strip()
            os.close(read_end)
            if not port:
                os._exit(1)
            os.chdir(request["cwd"])
            env = dict(base, MASTER_PORT=port, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
            os._exit(_rank_main(request["bundle"], env, request.get("script"), request.get("argv")))
        os.close(read_end)
        port_pipes.append(write_end)
        ranks[pid] = rank
    from _rendezvous import host

    store = host(nproc)  # served by this leader until the ranks end
    for fd in port_pipes:
        os.write(fd, f"{store.port}\n".encode())
        os.close(fd)
    codes, failed = {}, None
    wake = _pidfds(ranks)  # a rank's death wakes the select at once, not at the next 0.2 s poll
    while len(codes) < nproc:
        dead = _reap(ranks)
        if dead is None:  # no child left to wait for
            break
        for pid, _ in dead:  # a reaped rank's pidfd stays readable: stop watching it
            if pid in wake:
                os.close(wake.pop(pid))
        if not dead:
            readable, _, _ = select.select([conn, *wake.values()], [], [], 0.2)
            if conn in readable and not conn.recv(1, socket.MSG_PEEK):  # the client went away: end the run
                os.killpg(0, signal.SIGKILL)
            continue
        codes.update((ranks[pid], code) for pid, code in dead)
        # torchrun: one worker failed -> SIGTERM the others, report the first. Ranks found dead in one sweep died
        # together as far as we can tell; a rank killed by a signal is the cause, the others' exit 1 its echo
        # (CI: rank 1 SIGKILLed, rank 0's gloo read failed within the same poll, and rank 0 was reaped first).
        failures = sorted((code >= 0, ranks[pid], code) for pid, code in dead if code != 0)
        if failures and failed is None:
            _, failed, code = failures[0]
            os.write(2, f"zygote: rank {failed} exited with code {code}; stopping the other ranks\n".encode())
            for other in ranks:
                if ranks[other] not in codes:
                    try:
                        os.kill(other, signal.SIGTERM)
                    except ProcessLookupError:
                        pass
    rc = 0 if failed is None and all(c == 0 for c in codes.values()) else 1
    conn.sendall(json.dumps({"rc": rc, "codes": codes}).encode() + b"\n")
    os._exit(0)


def _reap(ranks: dict) -> list[tuple[int, int]] | None:
    """Every rank that has ended by now, (pid, exit code), without waiting; None when no child is left."""
    dead = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return dead or None
        if pid == 0:
            return dead
        if pid in ranks:  # a grandchild re-parented to us cannot happen (not a subreaper); be safe
            dead.append((pid, os.waitstatus_to_exitcode(status)))


def _pidfds(ranks: dict) -> dict[int, int]:
    """A pollable descriptor per rank process, by pid (Linux 5.3+); fewer where the kernel has no pidfd_open
    (the 0.2 s poll still finds every death)."""
    fds = {}
    for pid in ranks:
        try:
            fds[pid] = os.pidfd_open(pid)
        except (AttributeError, OSError):
            break
    return fds


def serve(path: str) -> None:
    """Warm up, then answer requests until stdin closes (the test session ended)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _warm()
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # leaders are reaped by the kernel
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(16)
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([server, sys.stdin], [], [])
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            return
        if server not in readable:
            continue
        conn, _ = server.accept()
        data, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
        while not data.endswith(b"\n"):
            data += conn.recv(1 << 20)
        request = json.loads(data)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            server.close()
            os.setpgid(0, 0)
            _leader(conn, request, *fds)
        try:
            os.setpgid(pid, pid)  # also here: the client may signal the group as soon as it has the pid
        except (PermissionError, ProcessLookupError):
            pass
        conn.close()
        for fd in fds:
            os.close(fd)


# --- client side (the pytest process) -------------------------------------------------------------------------
class ZygoteRun:
    """A run started through the server, with the parts of ``subprocess.Popen`` that
    ``_rank_harness.communicate_on_progress`` uses: ``pid`` (the leader; its process group holds the ranks),
    ``stdout``/``stderr`` (text streams), ``poll()``, ``wait()``, ``returncode``."""

    def __init__(self, sock_path: str, bundle: str, nproc: int, cwd: str, env: dict, script: str | None = None,
                 argv: list | None = None):
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(sock_path)
        request = json.dumps({"bundle": bundle, "nproc": nproc, "cwd": cwd, "env": env, "script": script,
                              "argv": argv}).encode() + b"\n"
        socket.send_fds(self._conn, [request], [out_w, err_w])
        os.close(out_w)
        os.close(err_w)
        self.stdout = os.fdopen(out_r, "r")
        self.stderr = os.fdopen(err_r, "r")
        self._buffer = b""
        self.pid = self._message()["pid"]
        self.returncode = None
        self.args = ["zygote", bundle, str(nproc)]

    def _message(self, block: bool = True):
        while b"\n" not in self._buffer:
            if not block and not select.select([self._conn], [], [], 0)[0]:
                return None
            chunk = self._conn.recv(65536)
            if not chunk:
                return {"rc": -signal.SIGKILL}  # the leader died without a word (killed)
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def poll(self):
        if self.returncode is None:
            message = self._message(block=False)
            if message is not None:
                self.returncode = message["rc"]
                self._conn.close()
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                import subprocess

                raise subprocess.TimeoutExpired(self.args, timeout)
            select.select([self._conn], [], [], 0.2)
        return self.returncode


if __name__ == "__main__":
    serve(sys.argv[1])
