"""Run the rank wing (``launcher.rank``) under torchrun on CPU for tests: write a bundle, run, parse the step lines."""
from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[1]
STEP = re.compile(r"^step\s+(\d+) \| loss ([0-9.]+) \| lr (\S+) \| grad_norm ([0-9.]+) .*TFLOP/s ([0-9.]+)")

# Small and fast: 2 layers, hidden 64, seq 64; 8 sequences per step as 4 micro-batches of 2.
TINY = ["data=mock", "model.num_layers=4", "model.hidden_size=64", "model.ffn_hidden_size=128",
        "model.num_attention_heads=4", "model.num_query_groups=2", "model.seq_length=64",
        "model.vocab_size=1024", "model.make_vocab_size_divisible_by=64", "train.micro_batch_size=2",
        "train.global_batch_size=8", "train.eval_interval=0", "logging.tensorboard=false",
        "checkpoint.save_at_end=false", "train.warmup_steps=1", "train.lr=3e-3"]


def layout(tp: int = 1, pp: int = 1, vpp: int = 0, ep: int = 1) -> List[str]:
    out = [f"parallel.tensor={tp}", f"parallel.pipeline={pp}", f"parallel.expert={ep}"]
    if vpp:
        out += [f"parallel.virtual_pipeline={vpp}", "schedule.kind=interleaved"]
    return out


def write_bundle(bundle: Path, overrides: Sequence[str], nproc: int = 1) -> Path:
    """A bundle holding just config.yaml, for a job of ``nproc`` ranks on this one node."""
    from launcher.config import compose_job, job_to_yaml

    bundle.mkdir(parents=True, exist_ok=True)
    if not any(o.startswith("cluster.gpus_per_node=") for o in overrides):
        overrides = [*overrides, f"cluster.gpus_per_node={nproc}"]
    (bundle / "config.yaml").write_text(job_to_yaml(compose_job(list(overrides))))
    return bundle


def run_train(bundle: Path, nproc: int, timeout: int = 240, env: Optional[dict] = None,
              what: Optional[str] = None) -> subprocess.CompletedProcess:
    """torchrun of the bundle to its end. ``timeout`` is a hang detector on progress, not on total time: the run
    is killed (and this raises) once it has printed nothing for ``timeout`` s; a slow run that keeps printing
    steps runs to its end however loaded the machine is. ``env`` adds to (or overrides) the ranks' environment;
    ``what`` names the run in a hang message."""
    cmd, proc = _start(["-m", "launcher.rank", "--bundle", str(bundle)], nproc, env)
    out, err = communicate_on_progress(proc, timeout, what or f"torchrun of {bundle.name} ({nproc} ranks)")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_worker(script: Path, args: Sequence[str], nproc: int, what: str, timeout: int = 300,
               env: Optional[dict] = None) -> subprocess.CompletedProcess:
    """``torchrun --nproc_per_node=N SCRIPT ARGS`` for a test's own rank worker (tests/_*_worker.py), through the
    warm rank server where it serves (as run_train). ``timeout``: the hang detector, on progress (no output)."""
    cmd, proc = _start([str(script), *map(str, args)], nproc, env)
    out, err = communicate_on_progress(proc, timeout, what)
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _start(target: List[str], nproc: int, extra_env: Optional[dict], stderr=subprocess.PIPE):
    """Start ``torchrun --nproc_per_node=N TARGET`` (``-m launcher.rank --bundle B`` or a worker script and its
    arguments): forked from the warm rank server where it serves this environment, else torchrun itself. An
    explicit ``extra_env`` always means torchrun (a test that sets variables wants fresh interpreters).
    Returns the torchrun command the run stands for and the process (stdout a text pipe)."""
    env = run_env(extra_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone", *target]
    zygote = None if extra_env else _zygote_for(env)
    if zygote is None and not extra_env and env.get("LAUNCHER_TEST_TORCHRUN") != "1":
        import warnings  # shown in pytest's warnings summary (also under xdist): a slow run for a reason to fix

        warnings.warn(f"rank harness: {' '.join(target[:3])} ran under torchrun, not the warm rank server: the "
                      f"test process's environment differs from the server's in {import_time_diff(env)}")
    if zygote is None:
        return cmd, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=stderr, text=True,
                                     start_new_session=True)
    if target[0] == "-m":
        proc = zygote.start(Path(target[-1]), nproc, env)
    else:
        proc = zygote.start(Path(target[0]), nproc, env, target[0], target[1:])
    if stderr is subprocess.DEVNULL:
        import threading

        threading.Thread(target=proc.stderr.read, daemon=True).start()  # drained, as DEVNULL does for torchrun
    return cmd, proc


RANK_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
"""What every test run's ranks get on top of the test's environment (torchrun would set OMP_NUM_THREADS=1 too)."""
LAUNCH_HOOKS: list = []
"""Called with the torchrun command that a run the zygote serves stands for (tests/conftest.py's lane guard records
them: a zygote run starts no process the guard's Popen hook could see)."""
_VOLATILE_ENV = ("PYTEST_CURRENT_TEST",)


class _Zygote:
    """The session's warm rank server (tests/_rank_zygote.py), started on first use with the session's environment
    (``_SESSION_ENV``), stopped at exit."""

    def __init__(self, env: dict):
        import atexit
        import tempfile

        self.dir = tempfile.mkdtemp(prefix="rank-zygote-")
        self.sock = os.path.join(self.dir, "sock")
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "_rank_zygote.py"), self.sock], cwd=ROOT,
                                     env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        ready = self.proc.stdout.readline().strip()
        if ready != "ready":
            raise RuntimeError(f"the rank zygote did not start (exit {self.proc.poll()}): {ready!r}")
        atexit.register(self.stop)

    def start(self, bundle: Path, nproc: int, env: dict, script: Optional[str] = None, argv: Sequence[str] = ()):
        from _rank_zygote import ZygoteRun

        target = [script, *argv] if script else ["-m", "launcher.rank", "--bundle", str(bundle)]
        for hook in LAUNCH_HOOKS:  # the torchrun command this run stands for
            hook([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--standalone",
                  *target])
        return ZygoteRun(self.sock, str(bundle), nproc, str(ROOT), env, script, list(argv) if script else None)

    def stop(self) -> None:
        import shutil

        with contextlib.suppress(OSError):
            self.proc.stdin.close()  # the server returns once its stdin closes
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=30)
        if self.proc.poll() is None:
            self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_ZYGOTE: list = []
_SESSION_ENV = {k: v for k, v in dict(os.environ, **RANK_ENV).items() if k not in _VOLATILE_ENV}
"""The environment the rank server starts with: the test session's own, as it was when this module was imported
(before any test could set a variable)."""
IMPORT_TIME_PREFIXES = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "OPENBLAS_", "GOTO", "NVTE_", "CUDA",
                        "NCCL_", "LD_", "MALLOC", "TRITON", "WANDB_", "MPLBACKEND", "MATPLOTLIB", "HF_", "TRANSFORMERS")
"""Variables that torch, Megatron-Core and the libraries the server imports may read at import time (or that change
how the interpreter starts). A forked rank runs with the run's own environment (os.environ is replaced), so the
others may differ freely (SLURM_JOB_ID, LAUNCHER_*, a preprocessor's RAYON_NUM_THREADS left in the test process);
a run that differs in one of these goes to torchrun."""


SET_BY_LIBRARIES = ("TORCHINDUCTOR_CACHE_DIR", "NVTE_FLASH_ATTN", "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")
"""Variables (prefixes) a library writes into its own process's environment, derived from defaults or from a model
it built: TorchInductor's ``cache_dir()`` stores ``/tmp/torchinductor_<user>``; Megatron-Core's
``LanguageModule._set_attention_backend`` (language_module.py:114-142) sets NVTE_{FLASH,FUSED,UNFUSED}_ATTN[_V*]
from the model's attention backend, and asserts on a conflicting value already there. A test that built a model
in-process must not hand them to the next run (whose model may use another backend), and they must not send it to
torchrun (CI: one in-process HF test, and every later run of that worker went to torchrun). A run gets them as
the session started, like every rank computes them itself."""


def run_env(extra: Optional[dict] = None) -> dict:
    """The environment of a test run's ranks: the test process's, less what libraries wrote into it
    (SET_BY_LIBRARIES, restored to the session's start), plus RANK_ENV and ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(SET_BY_LIBRARIES)}
    env.update({k: v for k, v in _SESSION_ENV.items() if k.startswith(SET_BY_LIBRARIES)})
    return dict(env, **RANK_ENV, **(extra or {}))


CRASH_SITE = ROOT / "tests" / "_crash_site"
"""The test site (its sitecustomize.py) that injects crashes, NaNs, spikes, slow writes and slow steps into ranks."""


def crash_site_env(base: Optional[dict] = None, **variables: str) -> dict:
    """``base`` (default: os.environ) with tests/_crash_site first on PYTHONPATH and its LAUNCHER_TEST_* ``variables``."""
    base = dict(os.environ if base is None else base)
    path = os.pathsep.join(p for p in (str(CRASH_SITE), base.get("PYTHONPATH", "")) if p)
    return dict(base, PYTHONPATH=path, **variables)


def _import_time(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME_PREFIXES)}


def import_time_diff(env: dict) -> list:
    """The import-time variables in which ``env`` differs from the rank server's (why a run goes to torchrun)."""
    a, b = _import_time(env), _import_time(_SESSION_ENV)
    return sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))


def _zygote_for(env: dict) -> Optional[_Zygote]:
    """The warm rank server for a run with this environment, or None: torchrun then (LAUNCHER_TEST_TORCHRUN=1,
    or the environment differs from the one the server started with: a value read at import would be stale)."""
    if env.get("LAUNCHER_TEST_TORCHRUN") == "1" or _import_time(env) != _import_time(_SESSION_ENV):
        return None
    if not _ZYGOTE or _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE[:] = [_Zygote(dict(_SESSION_ENV))]
    return _ZYGOTE[0]


def kill_tree(pid: int) -> None:
    """SIGKILL process ``pid``, its process group and every descendant. A group is not enough: torchrun (torch
    2.x ``SubprocessHandler``) starts each rank with ``start_new_session=True``, so ``killpg`` of torchrun's group
    left the ranks running as orphans (seen: a 100,000-step run training on for 20 minutes beside the suite)."""
    import signal

    import psutil

    try:
        procs = [psutil.Process(pid)]
        procs += procs[0].children(recursive=True)  # before the kill: orphans are re-parented and lost
    except psutil.NoSuchProcess:
        procs = []
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()


def communicate_on_progress(proc: subprocess.Popen, idle_s: float, what: str) -> tuple[str, str]:
    """``proc.communicate()``, except that a process (group) that writes nothing to stdout or stderr for
    ``idle_s`` seconds is SIGKILLed and reported as hung, naming ``what`` and its last line. Started with
    ``start_new_session=True``, its whole tree goes (torchrun and its ranks: kill_tree)."""
    import threading
    import time

    chunks = {"out": [], "err": []}
    last = [time.monotonic()]

    def pump(stream, key):
        for line in iter(stream.readline, ""):
            chunks[key].append(line)
            last[0] = time.monotonic()

    pumps = [threading.Thread(target=pump, args=(s, k), daemon=True)
             for s, k in ((proc.stdout, "out"), (proc.stderr, "err")) if s is not None]
    for t in pumps:
        t.start()
    hung = False
    while proc.poll() is None:
        if time.monotonic() - last[0] > idle_s:
            hung = True
            kill_tree(proc.pid)
            break
        time.sleep(0.2)
    proc.wait()
    for t in pumps:
        t.join(timeout=10)  # a grandchild holding the pipe open must not hold the test
    out, err = "".join(chunks["out"]), "".join(chunks["err"])
    if hung:
        tail = (out + err).strip().splitlines()[-1:] or ["(nothing)"]
        raise AssertionError(f"hang: {what} printed nothing for {idle_s:.0f} s (last line: {tail[0][:300]})\n"
                             f"{out[-3000:]}\n{err[-3000:]}")
    return out, err


def steps(stdout: str) -> Dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        m = STEP.match(line)
        if m:
            out[int(m[1])] = {"loss": float(m[2]), "lr": float(m[3]), "grad_norm": float(m[4]),
                              "tflops": float(m[5])}
    return out


class Run:
    """A finished run: stdout, per-step metrics from report/metrics.json (full precision), final numbers."""

    def __init__(self, bundle: Path, proc: subprocess.CompletedProcess):
        import json

        self.bundle, self.stdout = bundle, proc.stdout
        report = json.loads((bundle / "report" / "metrics.json").read_text())
        self.final = report["final"]
        self.steps = {int(h["step"]): h for h in report["steps"]}
        self.evals = report["eval"]

    def losses(self) -> Dict[int, float]:
        return {s: h["loss"] for s, h in self.steps.items()}


def train(tmp: Path, name: str, nproc: int, overrides: Sequence[str]) -> Run:
    bundle = write_bundle(tmp / name, overrides, nproc)
    proc = run_train(bundle, nproc)
    assert proc.returncode == 0, (f"{name} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-6000:]}\n{rank_log_tails(bundle)}")
    return Run(bundle, proc)


def rank_log_tails(bundle: Path, chars: int = 3000) -> str:
    """The end of every log in the bundle (a crashed rank's stack is in its own, launcher.rank.console.
    open_rank_log; the test's tmp dir is gone a few runs later)."""
    return "".join(f"--- {f.name}\n{f.read_text(errors='replace')[-chars:]}\n"
                   for f in sorted((Path(bundle) / "logs").glob("*")))


def run_until(bundle: Path, nproc: int, marker: str, timeout: int = 240, env: Optional[dict] = None) -> str:
    """Start a run and SIGKILL its whole process group (torchrun + ranks, started here) as soon as a stdout
    line contains ``marker``: a crash, not a clean exit. Returns the stdout seen. ``env``: as ``run_train``'s."""
    import threading
    import time

    _, proc = _start(["-m", "launcher.rank", "--bundle", str(bundle)], nproc, env, stderr=subprocess.DEVNULL)
    # ``timeout`` is a hang detector on progress: the run is killed once it has printed nothing for that long
    # (a watchdog thread: the readline below blocks while nothing comes)
    seen, last, done = [], [time.monotonic()], threading.Event()

    def watchdog():
        while not done.wait(0.5):
            if time.monotonic() - last[0] > timeout:
                kill_tree(proc.pid)
                return

    threading.Thread(target=watchdog, daemon=True).start()
    try:
        for line in proc.stdout:
            seen.append(line)
            last[0] = time.monotonic()
            if marker in line:
                break
    finally:
        done.set()
        kill_tree(proc.pid)  # torchrun, its ranks (each in a session of its own) and their helpers
        proc.wait()
    return "".join(seen)


def single_process_group() -> None:
    """A world-1 gloo process group + Megatron parallel state (TP=PP=EP=1) in this test process; idempotent."""
    import torch.distributed as dist

    from models import cpu_compat

    cpu_compat.apply()
    if not dist.is_initialized():
        from _rendezvous import init_single

        init_single()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        from megatron.core import tensor_parallel

        parallel_state.initialize_model_parallel()
        tensor_parallel.model_parallel_cuda_manual_seed(1)


@contextlib.contextmanager
def run_with_a_stopped_rank(bundle: Path, rank: int, step: int = 3, within_s: float = 600):
    """Run ``bundle``'s launch.sh (so the agent's watchdog runs) and SIGSTOP ``rank`` once step ``step`` is
    logged; yields the launch process (its stdout past that line unread). On exit the stopped rank and the
    launch's process group are killed, whatever happened. Shared by the CPU hang test and the GPU lane's."""
    import json
    import signal
    import time

    from launcher.rank import forensics

    proc = subprocess.Popen(["bash", str(bundle / "launch.sh")], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    stopped = None
    try:
        deadline = time.monotonic() + within_s
        while time.monotonic() < deadline and proc.poll() is None:
            if re.match(rf"step +{step} \|", proc.stdout.readline()):
                stopped = int(json.loads(forensics.state_path(bundle, rank).read_bytes())["pid"])
                os.kill(stopped, signal.SIGSTOP)
                break
        assert stopped is not None, f"the run never reached step {step}"
        yield proc
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGKILL)
            except OSError:
                pass
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
