"""Shared test helpers: compose jobs, run the CLI in-process, and locate the repository."""
from __future__ import annotations

import ast
import contextlib
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# A suite started in the background by a non-interactive shell (`make test &`, a CI step, the load benchmark)
# inherits SIGINT ignored, and every process it starts keeps it ignored (exec keeps SIG_IGN): the launcher's
# Ctrl-C path then never runs and test_signals' Ctrl-C test trains to its end. A terminal's foreground job has
# SIGINT at its default; so do the suite's processes.
import signal as _signal  # noqa: E402

if _signal.getsignal(_signal.SIGINT) is _signal.SIG_IGN:
    _signal.signal(_signal.SIGINT, _signal.default_int_handler)

RECIPES = sorted(p.stem for p in (ROOT / "recipes" / "recipe").glob("*.yaml"))


@pytest.fixture
def cli(capsys):
    """Run `python -m launcher ARGS` in-process; returns (exit code, stdout, stderr)."""
    from launcher.cli import main

    def run(*args: str):
        code = main(list(args))
        out = capsys.readouterr()
        return code, out.out, out.err
    return run


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """``_rank_harness.train(...)`` once per distinct job in the whole session: the uninterrupted runs that the
    resume and reshard tests compare losses with (and load step checkpoints from, with checkpoint.load=, which
    reads them) are the same jobs, so each is trained once. Keyed by the composed config, not by the spelling
    of the overrides."""
    from _rank_harness import train
    from launcher.config import compose_job, job_to_yaml

    runs: dict = {}

    def get(nproc: int, overrides):
        key = job_to_yaml(compose_job([*overrides, f"cluster.gpus_per_node={nproc}"]))
        if key not in runs:
            runs[key] = train(tmp_path_factory.mktemp("reference"), "uninterrupted", nproc, overrides)
        return runs[key]
    return get


# --- Lanes --------------------------------------------------------------------------------------------------
# `make test-fast` deselects the markers below; `make test` runs everything. The marks are given here, from what
# a test does, not by hand in each file, so a new test file lands in the right lane without anyone remembering
# a marker; a runtime guard (``_lane_guard``) fails a test that starts ranks or talks to the real Slurm without
# its mark (a helper in another module can hide a spawn from the static reading).
LANE_MARKS = ("multirank", "slurm", "gpu", "slow")
SLOW_MODULES = {
    # CPU seconds are shares of one `make test-fast` run at load averages 11-63 (13.4 CPU min in all before these
    # moved here); the fast lane's budget is 3 minutes on 2 idle cores
    "tests/test_validate_differential.py":
        "builds every accepted mutation of two recipes in Megatron-Core (two probe processes, ~1,000 models): the "
        "suite's slowest test (212 s in a full run at load 5-9, issue 25)",
    "tests/test_fuzz_cli.py": "2,000 fuzzed override sets through the CLI: 15% of the fast lane's CPU time alone",
    "tests/test_plan_api.py::test_plan_and_search_every_recipe":
        "a layout search for every recipe on three clusters (35 searches, up to 2.5 CPU s each; 12%)",
    "tests/test_invalid_configs.py::test_every_printed_alternative_validates":
        "re-validates every alternative printed for 125 refused configs, each through the hint search (9%)",
    "tests/test_catalogue.py::test_architecture_builds_and_steps_on_cpu":
        "builds and steps every architecture in Megatron-Core in this process (rank side)",
    "tests/test_wiring.py::test_mtp_block_spec_reaches_the_last_chunk": "21 Megatron-Core model builds (rank side)",
    "tests/test_train_gpu_proxy.py": "trains benchmarks/gpu_proxy.py's tiny model on CPU in a subprocess",
    "tests/test_plan_activations_real.py": "runs real models to count their saved tensors, in a subprocess",
    "tests/test_data_preprocess.py::test_byte_identical_to_reference_encoding":
        "encodes the corpus with the reference tokenizer path too (4 cases, 4%)",
    "tests/test_nccl_semantics.py::test_every_executed_schedule_replays_under_nccl_rules_for_pp_2_to_16":
        "replays every executed schedule for PP 2..16 (90 s of setup at load 60)",
    "tests/test_hf.py::test_hf_import_export_round_trip_and_logits":
        "builds Megatron-Core models in this process, 2-3 per architecture (19 s for all six at load 8)",
    "tests/test_hf_slurm.py::test_the_bound_covers_the_importers_largest_tensor_group":
        "builds Megatron-Core models on the meta device in this process, 3-4 per architecture",
    "tests/test_hf_load.py": "runs import-hf (a Megatron-Core build and save) in a subprocess: 15-36 s at load 8-16",
    "tests/test_nccl_semantics.py::test_zb_h1_executor_issues_exactly_the_planned_program":
        "reads the same fake-rank recording of every schedule at PP 2..16 (48 s of setup, idle-ish): in the fast "
        "lane it would record it a second time",
}
"""test module, or module::test function -> why it is in the `slow` lane although it starts no ranks."""
_SPAWNS_RANKS = re.compile(r"""["'](?:torch\.distributed\.run|torchrun|launcher\.rank)["']|action=(?:run|bench)"""
                           r"""|--nproc_per_node"""
                           r"""|["']bash["'],[^\]\n]*["']launch\.sh["']"""  # a bundle's launch.sh: torchrun and its ranks
                           r"""|\bmp\.spawn\(|multiprocessing\.spawn\(""")
_STARTS_PER_RANK = re.compile(r"for rank in range\(")


def _spawns_ranks(source: str) -> bool:
    """torchrun/launcher.rank/action=run/action=bench/mp.spawn, `bash <bundle>/launch.sh` (its torchrun and ranks),
    or a Popen per rank (a test's own gloo workers)."""
    return bool(_SPAWNS_RANKS.search(source) or ("Popen(" in source and _STARTS_PER_RANK.search(source)))


def _runs_the_default_action(func: ast.AST) -> bool:
    """A literal `[python, "-m", "launcher", ...]` without an action=: on the default cluster=local that trains
    (the embedded default). A list with *args is not read (its action is not known here)."""
    for node in ast.walk(func):
        if not isinstance(node, ast.List):
            continue
        words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
        if not any(a == "-m" and b == "launcher" for a, b in zip(words, words[1:])):
            continue
        if any(isinstance(e, ast.Starred) for e in node.elts):
            continue
        text = [ast.unparse(e) for e in node.elts]
        if not any("action=" in t or "--help" in t or "--cfg" in t for t in text):
            return True
    return False


_RANK_HELPERS = {"train", "run_train", "run_until", "run_worker", "run_with_a_stopped_rank"}
"""`_rank_harness` functions that start torchrun."""
_RANK_FIXTURES = {"reference_run"}
_SLURM_FIXTURES = {"slurm", "slurm_cluster"}
_SLURM_TOOLS = {"sbatch", "srun", "salloc", "squeue", "scontrol", "scancel", "sinfo"}


class _ModuleSpawns:
    """Which module-level functions of a test module start ranks, directly or through another function of the
    same module (a helper, a fixture), read from the source once."""

    def __init__(self, path: Path):
        tree = ast.parse(path.read_text())
        funcs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            funcs.update({f"{cls.name}.{n.name}": n for n in cls.body if isinstance(n, ast.FunctionDef)})
        from_harness = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                        and n.module == "_rank_harness" for a in n.names if a.name in _RANK_HELPERS}
        source = path.read_text()
        calls = {name: {n.id for n in ast.walk(f) if isinstance(n, ast.Name)} for name, f in funcs.items()}
        spawns = {name for name, f in funcs.items()
                  if _spawns_ranks(ast.get_source_segment(source, f) or "") or calls[name] & from_harness
                  or _runs_the_default_action(f)}
        spawns |= {name for name, f in funcs.items() if {a.arg for a in f.args.args} & _RANK_FIXTURES}
        if spawns or _spawns_ranks(source):  # a function that runs this very file as a script runs its ranks too
            spawns |= {name for name, f in funcs.items() if "__file__" in (seg := ast.get_source_segment(source, f)
                                                                            or "") and "subprocess." in seg}
        while True:  # through helpers and fixtures of the same module
            more = {name for name in funcs if name not in spawns and calls[name] & spawns}
            if not more:
                break
            spawns |= more
        self.funcs, self.spawns = funcs, spawns


def _lane_of(item, modules: dict) -> set:
    path = Path(str(item.fspath))
    if path not in modules:
        modules[path] = _ModuleSpawns(path)
    mod = modules[path]
    name = item.function.__name__ if hasattr(item, "function") else item.name
    if getattr(item, "cls", None) is not None:
        name = f"{item.cls.__name__}.{name}"
    used = set(getattr(item, "fixturenames", ())) | {name}
    lanes = set()
    if used & mod.spawns or used & _RANK_FIXTURES:
        lanes.add("multirank")
    if used & _SLURM_FIXTURES:
        lanes.add("slurm")
    rel = path.relative_to(ROOT).as_posix()
    if rel.startswith("tests/gpu/"):
        lanes.add("gpu")
    if rel in SLOW_MODULES or f"{rel}::{item.originalname if hasattr(item, 'originalname') else name}" in SLOW_MODULES:
        lanes.add("slow")
    return lanes


def _xdist_group(item, lanes: set) -> str | None:
    """The pytest-xdist group of a rank or Slurm test (`make test` runs them two at a time, ``--dist loadgroup``):
    every Slurm test in one worker (the session's one-node cluster is started and stopped by one process), every
    user of the session's ``reference_run`` in one worker (each reference run trained once), and the rest by
    module (a module-scoped trained fixture is trained once). In-process tests stay ungrouped."""
    if "slurm" in lanes:
        return "slurm"
    if "multirank" not in lanes:
        # an in-process test using its module's own module-scoped fixture (test_nccl_semantics' fake-rank traces,
        # ~30 s) runs beside the module's other users of it: ungrouped, each worker that ran one set it up again
        # whenever it came back from another module (seen: three set-ups of the same traces in one session)
        return _module_path(item) if _uses_own_module_fixture(item) else None
    if set(getattr(item, "fixturenames", ())) & _RANK_FIXTURES:
        return "reference-runs"
    return _module_path(item)


def _module_path(item) -> str:
    return Path(str(item.fspath)).relative_to(ROOT).as_posix()


def _uses_own_module_fixture(item) -> bool:
    info = getattr(item, "_fixtureinfo", None)
    module = getattr(getattr(item, "module", None), "__name__", None)
    for defs in (info.name2fixturedefs.values() if info else ()):
        last = defs[-1]
        if last.scope in ("module", "package", "session") and getattr(last.func, "__module__", None) == module:
            return True
    return False


_MODULES: dict = {}
"""Test module path -> its ``_ModuleSpawns`` (read once per session)."""


def pytest_itemcollected(item):
    """Lane marks and the xdist group, as each test is collected: pytest-xdist reads the xdist_group marks in its own
    ``pytest_collection_modifyitems`` (xdist/remote.py), which ran before this conftest's (the groups were silently
    ignored: every worker trained the shared reference runs and started Slurm)."""
    lanes = _lane_of(item, _MODULES)
    for lane in sorted(lanes):
        item.add_marker(getattr(pytest.mark, lane))
    group = _xdist_group(item, lanes)
    if group:
        item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(config, items):
    cuda = None
    for item in items:
        if item.get_closest_marker("gpu"):
            if cuda is None:
                cuda = _cuda_available()
            if not cuda:
                item.add_marker(pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is False)"))
    # the long poles first: pytest-xdist (--dist loadgroup) hands out work units (a group, or one ungrouped test)
    # in the order of their first test, so the biggest start at once and overlap the rest instead of running alone
    # at the end
    items.sort(key=_long_poles_first)


LONGEST = ("slurm", "tests/test_zero_bubble.py", "tests/test_validate_differential.py", "tests/test_nothing_lost.py",
           "reference-runs", "tests/test_fuzz_cli.py", "tests/test_signals.py")
"""The biggest work units, biggest first (a part-2 run at load 15-30, worker-seconds: the Slurm group 606, ZB 513,
nothing-lost 207, the shared reference runs 195, signals 33 once its Ctrl-C test was fixed; in-process at load 15:
the differential test ~200, the CLI fuzz ~135)."""


def _long_poles_first(item) -> tuple:
    marker = item.get_closest_marker("xdist_group")
    unit = marker.args[0] if marker and marker.args else Path(str(item.fspath)).relative_to(ROOT).as_posix()
    if unit in LONGEST:
        return (0, LONGEST.index(unit))
    slow = item.get_closest_marker("slow") or item.get_closest_marker("multirank")
    return (1, 0) if slow else (2, 0)


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _bash_runs_launch_sh(args: list) -> bool:
    """`bash [options] <bundle>/launch.sh` executes it; `bash -n` only parses it (test_recipes' syntax check)."""
    for i, word in enumerate(args):
        if not word.startswith("-"):
            return Path(word).name == "launch.sh" and not any(
                w.startswith("-") and not w.startswith("--") and "n" in w[1:] for w in args[:i])
    return False


def _lane_needed(argv) -> str | None:
    """The mark a child process with this argv needs, if any."""
    if isinstance(argv, (str, bytes)):
        argv = [argv]
    words = [str(a) for a in argv]
    if "torch.distributed.run" in words or "launcher.rank" in words or "launcher.rank.agent" in words \
            or Path(words[0]).name == "torchrun" \
            or (Path(words[0]).name == "bash" and _bash_runs_launch_sh(words[1:])) \
            or ("launcher" in words and ("action=run" in words or "action=bench" in words)):
        return "multirank"
    tool = Path(words[0]).name
    if words[0].endswith("slurm/localhost/start.sh") or any(w.endswith("slurm/localhost/start.sh") for w in words):
        return "slurm"
    if tool in _SLURM_TOOLS:
        found = shutil.which(words[0]) if "/" not in words[0] else words[0]
        if found and not Path(found).resolve().is_relative_to(Path(tempfile.gettempdir()).resolve()):
            return "slurm"  # the real one, not a test's stand-in script in a temporary directory
    return None



@pytest.fixture(autouse=True)
def _lane_guard(request, monkeypatch):
    """Fails a test that starts ranks or uses the real Slurm without the lane's mark (so `make test-fast` never
    trains or queues by accident, and the static marking above cannot silently go stale)."""
    original = subprocess.Popen.__init__
    seen: list = []

    def record(args):
        lane = _lane_needed(args)
        if lane:
            seen.append((lane, args))

    def recording(self, args, *a, **kw):
        record(args)
        return original(self, args, *a, **kw)

    monkeypatch.setattr(subprocess.Popen, "__init__", recording)
    import _rank_harness

    # a run the warm rank server (tests/_rank_zygote.py) serves starts no process of its own: its torchrun command
    monkeypatch.setattr(_rank_harness, "LAUNCH_HOOKS", [record])
    yield
    missing = [(lane, args) for lane, args in seen if not request.node.get_closest_marker(lane)]
    if missing:
        lane, args = missing[0]
        pytest.fail(f"{request.node.nodeid} starts {' '.join(map(str, args))[:200]} but is not marked {lane}: "
                    f"it would run in `make test-fast`; mark it `@pytest.mark.{lane}` (or start it through a "
                    f"helper of its own module, which tests/conftest.py reads)", pytrace=False)


# --- The one-node Slurm cluster -----------------------------------------------------------------------------
SLURM_START = ROOT / "slurm" / "localhost" / "start.sh"
SLURM_STOP = ROOT / "slurm" / "localhost" / "stop.sh"


def _slurm_daemons_alive() -> set:
    """Which of slurm/localhost's daemons run now, by their PID files (the ones start.sh and stop.sh use)."""
    import os

    state = Path(os.environ.get("SLURM_LOCAL_DIR", "/var/lib/slurm-localhost"))
    pidfiles = {"munged": Path("/run/munge/munged.pid"), "slurmctld": state / "slurmctld.pid",
                "slurmd": state / "slurmd.pid"}
    alive = set()
    for name, pidfile in pidfiles.items():
        try:
            pid = int(pidfile.read_text().strip())
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                alive.add(name)
        except (OSError, ValueError):
            pass
    return alive


def _sinfo_up() -> bool:
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return proc.returncode == 0 and any(s.strip() in {"idle", "mix", "alloc", "comp"} for s in proc.stdout.split())


def stop_started_slurm(started: set) -> str:
    """Stop the daemons in ``started`` (the ones this session started), unless jobs that are not this
    session's are queued (another engineer's suite may be using the cluster): then it is left running."""
    if not started:
        return "nothing to stop"
    if "slurmctld" in started or "slurmd" in started:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            queued = subprocess.run(["squeue", "-h", "-o", "%A"], capture_output=True, text=True, timeout=60)
            if queued.stdout.split():
                return f"left running: jobs {' '.join(queued.stdout.split())} are queued"
    proc = subprocess.run(["bash", str(SLURM_STOP), *sorted(started)], capture_output=True, text=True, timeout=120)
    return (proc.stdout + proc.stderr).strip()


@pytest.fixture(scope="session")
def slurm_cluster():
    """A responding one-node Slurm cluster for the whole session. Started with slurm/localhost/start.sh when
    `sinfo` does not answer (needs root); the daemons this session started are stopped at its end (also on
    interpreter exit), the ones it found running are left alone."""
    import atexit
    import os

    started: set = set()
    if not _sinfo_up():
        if os.geteuid() != 0:
            pytest.fail(f"Slurm is not running and starting it needs root: run `sudo bash {SLURM_START}` first")
        before = _slurm_daemons_alive()
        proc = subprocess.run(["bash", str(SLURM_START)], capture_output=True, text=True, timeout=900)
        started = _slurm_daemons_alive() - before
        if proc.returncode != 0:
            stop_started_slurm(started)
            pytest.fail(f"{SLURM_START} failed:\n{proc.stdout}\n{proc.stderr}")
    once = []

    def stop():
        if not once:
            once.append(stop_started_slurm(started))

    atexit.register(stop)
    try:
        assert _sinfo_up(), "Slurm does not answer: " + subprocess.run(
            ["sinfo", "-N", "-l"], capture_output=True, text=True).stdout
        for tool in ("sbatch", "scontrol", "scancel"):
            assert shutil.which(tool), f"{tool} not found"
        yield started
    finally:
        stop()
