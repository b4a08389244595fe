"""No correctness test asserts on how long something took: on a shared 2-core machine a duration says how busy
the machine was. Speed targets live in benchmarks/ (as ratios against a reference measured in the same run);
waits for an event (a file, a job state, a process to end) are hang detectors and are not asserts.

This reads every test module (and its helpers) and finds each ``assert`` that depends on a clock: a call of
``time.time/monotonic/perf_counter/thread_time/process_time`` (or their ``_ns`` forms, ``resource.getrusage``,
``os.times``), a name computed from one
in the same function (or unpacked from a same-module function that returns one), or a value whose name says it is
a duration (``elapsed``, ``took``, ``seconds``, ...; such values come back from subprocesses). Each one must be
in ALLOWED with why it is there: a 10x pathology bound, or a duration that *is* the product's promise.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from conftest import ROOT

TESTS = ROOT / "tests"
CLOCKS = {"time", "monotonic", "perf_counter", "thread_time", "process_time", "time_ns", "monotonic_ns",
          "perf_counter_ns", "thread_time_ns", "process_time_ns"}
DURATION_NAME = re.compile(r"(^|_)(elapsed|took|duration|walltime|wall_s|runtime)$")

ALLOWED = {
    "tests/test_hang_forensics.py::test_watchdog_dumps_stacks_and_reports_once_nothing_moves":
        "a lower bound: the watchdog must not report a hang before its threshold (timeouts.hang_s) has passed; a "
        "busy machine can only make it later, never earlier",
    "tests/test_nothing_lost.py::test_launcher_returns_within_a_minute_when_a_rank_dies_without_restarts":
        "the product's promise is the duration itself (README: the launcher returns within a minute of a rank "
        "dying); what it guards against is waiting forever on an orphaned checkpoint writer, and the launcher's "
        "own drain is 5 s, so 60 s is a 12x bound",
    "tests/test_nothing_lost.py::test_corrupt_newest_checkpoints_fall_back_with_a_warning_and_finish_with_the_same_losses":
        "tells 'all ranks fell back together' from 'a rank waited out the 10-minute process-group timeout': "
        "the bound (480 s) sits below that timeout and far above the run itself (30-60 s)",
    "tests/test_login_node.py::test_compose_validate_plan_render_import_no_torch":
        "10x pathology bound on the CPU seconds of validate+plan+render of 405B in one process (about 4 CPU s; "
        "the 'about a second' wall-time target is measured by benchmarks/login_node.py)",
    "tests/test_catalogue.py::test_list_prints_the_catalogue_in_about_a_second":
        "10x pathology bound on the CPU seconds of `python -m launcher action=list` (1.3-1.8 CPU s measured; "
        "the bound is 18): catches a catalogue that imports torch or plans every recipe many times over",
}
"""'path::function' -> why that function may assert on a duration."""


OTHER_CLOCKS = {("resource", "getrusage"), ("os", "times")}
"""CPU-time counters read as durations (ru_utime, ru_stime; os.times())."""


def _clock_call(node: ast.AST, clock_names: set) -> bool:
    if not isinstance(node, ast.Call):
        return False
    f = node.func
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and (f.value.id, f.attr) in OTHER_CLOCKS:
        return True
    return (isinstance(f, ast.Attribute) and f.attr in CLOCKS and isinstance(f.value, ast.Name)
            and f.value.id == "time") or (isinstance(f, ast.Name) and f.id in clock_names)


class _Scope:
    """Clock-derived values of one module: ``clock_funcs`` maps a same-module function to the positions of its
    returned tuple that are durations (None: the whole value)."""

    def __init__(self, clock_names: set):
        self.clock_names, self.clock_funcs = clock_names, {}

    def uses(self, node: ast.AST, tainted: set) -> bool:
        for sub in ast.walk(node):
            if _clock_call(sub, self.clock_names) or (isinstance(sub, ast.Name) and sub.id in tainted):
                return True
            if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and sub.func.id in self.clock_funcs \
                    and self.clock_funcs[sub.func.id] is None:
                return True
        return False

    def assigned(self, target: ast.AST, value: ast.AST, tainted: set) -> set:
        """Names that ``target = value`` makes clock-derived: element by element for tuples."""
        if isinstance(target, (ast.Tuple, ast.List)):
            if isinstance(value, (ast.Tuple, ast.List)) and len(value.elts) == len(target.elts):
                return set().union(*(self.assigned(t, v, tainted) for t, v in zip(target.elts, value.elts)))
            if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) \
                    and self.clock_funcs.get(value.func.id) is not None:
                return {n for i, t in enumerate(target.elts) if i in self.clock_funcs[value.func.id]
                        for n in _targets(t)}
        return set(_targets(target)) if self.uses(value, tainted) else set()

    def tainted(self, func: ast.AST) -> set:
        tainted: set = set()
        for _ in range(4):  # to a fixed point: t0 = clock(); dt = clock() - t0; ok = dt < 1
            for node in ast.walk(func):
                if isinstance(node, ast.Assign):
                    for t in node.targets:
                        tainted |= self.assigned(t, node.value, tainted)
                elif isinstance(node, (ast.AugAssign, ast.AnnAssign)) and node.value is not None:
                    tainted |= self.assigned(node.target, node.value, tainted)
        return tainted

    def returns(self, func: ast.AST):
        """False, None (the whole returned value is a duration) or the tuple positions that are."""
        tainted, out = self.tainted(func), False
        for r in ast.walk(func):
            if not isinstance(r, ast.Return) or r.value is None:
                continue
            if isinstance(r.value, ast.Tuple):
                hit = {i for i, e in enumerate(r.value.elts) if self.uses(e, tainted)}
                if hit:
                    out = hit | (out or set()) if out is not None else None
            elif self.uses(r.value, tainted):
                out = None
        return out


def _named_duration(node: ast.AST) -> bool:
    """A bound (<, <=, >, >=) on a value named as a duration (``result["elapsed"] < 6``); equalities are checks
    of arithmetic on given numbers, not measurements."""
    for cmp in ast.walk(node):
        if not (isinstance(cmp, ast.Compare) and any(isinstance(o, (ast.Lt, ast.LtE, ast.Gt, ast.GtE))
                                                     for o in cmp.ops)):
            continue
        for side in (cmp.left, *cmp.comparators):
            for sub in ast.walk(side):
                name = sub.id if isinstance(sub, ast.Name) else sub.attr if isinstance(sub, ast.Attribute) else \
                    sub.slice.value if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) else None
                if isinstance(name, str) and DURATION_NAME.search(name):
                    return True
    return False


def _targets(target: ast.AST):
    for sub in ast.walk(target):
        if isinstance(sub, ast.Name):
            yield sub.id


def timing_asserts(path: Path) -> list[tuple[str, int, str]]:
    """(function, line, source) of every assert in ``path`` that depends on a clock."""
    source = path.read_text()
    tree = ast.parse(source)
    scope = _Scope({a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                    and n.module == "time" for a in n.names if a.name in CLOCKS})
    funcs = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for _ in range(3):  # same-module helpers that return a duration (callers unpack it)
        for f in funcs:
            ret = scope.returns(f)
            if ret is not False:
                scope.clock_funcs[f.name] = ret
    found = []
    for f in funcs:
        tainted = scope.tainted(f)
        for node in ast.walk(f):
            if isinstance(node, ast.Assert) and (scope.uses(node.test, tainted) or _named_duration(node.test)):
                found.append((f.name, node.lineno, ast.get_source_segment(source, node).splitlines()[0]))
    return found


def _scanned() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if "fixtures" not in p.relative_to(TESTS).parts
                  and p.name != Path(__file__).name)


def test_no_test_asserts_on_a_duration_outside_the_allow_list():
    seen, unexplained = set(), []
    for path in _scanned():
        rel = path.relative_to(ROOT).as_posix()
        for func, line, text in timing_asserts(path):
            key = f"{rel}::{func}"
            seen.add(key)
            if key not in ALLOWED:
                unexplained.append(f"{rel}:{line} in {func}: {text}")
    assert not unexplained, (
        "timing asserts in correctness tests (a busy machine fails them): move the speed guard to benchmarks/ "
        "(a ratio against a reference measured in the same run), make it a 10x pathology bound and add it to "
        "ALLOWED in tests/test_no_timing_asserts.py with why, or wait on progress instead:\n" + "\n".join(unexplained))
    stale = sorted(set(ALLOWED) - seen)
    assert not stale, f"ALLOWED entries with no timing assert left (remove them): {stale}"
    assert all(len(why) > 40 for why in ALLOWED.values())


def test_the_scan_finds_each_kind_of_timing_assert(tmp_path):
    """The scanner itself: a direct clock call, a derived name, a duration unpacked from a helper, a duration
    named so in a subprocess's JSON; and nothing in a deadline loop (a hang detector) or an unrelated assert."""
    probe = tmp_path / "test_probe.py"
    probe.write_text(
        "import time\nfrom time import perf_counter as pc\n"
        "def helper():\n    t = time.monotonic()\n    return 1, time.monotonic() - t\n"
        "def test_direct():\n    t0 = time.thread_time()\n    assert time.thread_time() - t0 < 2\n"
        "def test_derived():\n    t0 = pc()\n    dt = pc() - t0\n    ok = dt < 1\n    assert ok\n"
        "def test_unpacked():\n    _, took = helper()\n    assert took < 5\n"
        "def test_named(result):\n    assert result['elapsed'] < 6.0\n"
        "def test_rusage():\n    import resource\n    a = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
        "    cpu = resource.getrusage(resource.RUSAGE_CHILDREN).ru_utime - a.ru_utime\n    assert cpu < 5.0\n"
        "def test_hang_detector():\n    deadline = time.monotonic() + 60\n"
        "    while time.monotonic() < deadline:\n        break\n    assert 1 + 1 == 2\n")
    assert [f for f, _, _ in timing_asserts(probe)] == ["test_direct", "test_derived", "test_unpacked", "test_named",
                                                              "test_rusage"]
