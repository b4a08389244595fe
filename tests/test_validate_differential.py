"""Differential test: whatever the login node accepts, Megatron-Core builds.

For the smoke model and a reduced-size MoE model (each on its recipe's TP2 x PP2 layout and in one process),
every numeric, boolean and choice field of ``model``,
``parallel``, ``schedule``, ``train`` and ``precision`` is set to edge values (0, -1, 1, odd, large, not
dividing, inf/nan, null, each allowed value and one that is not), alone and in seeded random pairs. For each job:

- ``validate`` never raises, and when it refuses the job one of its error lines names the mutated field (and,
  for single mutations, every override alternative it prints removes its problem without adding an error);
- otherwise the ranks' side accepts it: ``tests/_mcore_probe.py`` (one subprocess for all of them) constructs
  the exact Megatron-Core config objects, initialises Megatron's process groups for the job's real world size
  on torch's fake process group, builds rank 0's and the last rank's model chunks, DDP, the optimizer and the
  LR scheduler, and runs a forward/backward pass where the layout is one process.

The number of configurations tried is printed (``pytest -s``) and asserted to stay large.
"""
from __future__ import annotations

import copy
import dataclasses
import json
import math
import pickle
import random
import subprocess
import sys
import time

import pytest

from conftest import ROOT
from launcher.config import compose_job
from launcher.schema import SECTIONS
from launcher.fields import parse_value
from launcher.validate import errors, raw_problems, validate
from launcher.validate.hints import hint_overrides, problem_key

SECTIONS_MUTATED = ("model", "parallel", "schedule", "train", "precision")
SMALL_STEP = ["model.vocab_size=1024", "model.seq_length=64"]
BASES = {
    "smoke": ["recipe=smoke", "data=mock"],
    "moe": ["recipe=smoke", "data=mock", "model.num_experts=4", "model.moe_ffn_hidden_size=64",
            "model.moe_shared_expert_intermediate_size=128", "parallel.sequence_parallel=true",
            "parallel.expert=2", "parallel.expert_tensor=1"],
    # one process each: these also run a forward and backward pass (runtime failures, hangs), on a 1,024-word
    # vocabulary and 64-token sequences (CI budget: the probe's steps took 117 of its ~180 CPU seconds at the smoke
    # model's 8,192 words x 256 tokens, 41 at this size; the mutations and their edge values are the same fields')
    "smoke-1p": ["recipe=smoke", "data=mock", "parallel.tensor=1", "parallel.pipeline=1", "cluster.gpus_per_node=1",
                 *SMALL_STEP],
    "moe-1p": ["recipe=smoke", "data=mock", "parallel.tensor=1", "parallel.pipeline=1", "cluster.gpus_per_node=1",
               "model.num_experts=4", "model.moe_ffn_hidden_size=64", "model.moe_shared_expert_intermediate_size=128",
               "train.recompute=full", *SMALL_STEP],
}
PAIRS_PER_BASE = 100
SHARDS = 2
LARGE_INT = 1 << 14
SKIP = {"model.name"}
"""Free-form strings: nothing to mutate to an edge value."""


def _fields():
    for section in SECTIONS_MUTATED:
        for f in dataclasses.fields(SECTIONS[section]):
            name = f"{section}.{f.name}"
            if name not in SKIP:
                yield name, f


def _edge_values(f: dataclasses.Field, current):
    kind = str(f.type)
    values: list = []
    if "choices" in f.metadata:
        values = [*f.metadata["choices"], "bogus"]
    elif "bool" in kind:
        values = [True, False]
    elif "int" in kind:
        base = current if isinstance(current, int) and current > 0 else 4
        values = [0, -1, 1, 2, 3, 7, base + 1, 2 * base, LARGE_INT]
    elif "float" in kind:
        values = [0.0, -1.0, 1.0, 0.5, 1e9, math.inf, math.nan]
    if kind.startswith("Optional"):
        values.append(None)
    return [v for v in values if not (v == current and type(v) is type(current))]


def _mutated(job, changes):
    job = copy.deepcopy(job)
    for name, value in changes:
        section, attr = name.split(".")
        setattr(getattr(job, section), attr, value)
    return job


def _mutations(base_job):
    singles = []
    for name, f in _fields():
        section, attr = name.split(".")
        current = getattr(getattr(base_job, section), attr)
        singles += [((name, v),) for v in _edge_values(f, current)]
    rng = random.Random(20261201)
    pairs = set()
    while len(pairs) < PAIRS_PER_BASE:
        a, b = rng.sample(singles, 2)
        if a[0][0] != b[0][0]:
            pairs.add(a + b)
    return singles + sorted(pairs, key=repr)


def _names_a_field(problems, changes) -> bool:
    lines = [p.line() for p in errors(problems)]
    return any(name in line for line in lines for name, _ in changes)


@pytest.fixture(scope="module")
def verdicts():
    """(login-side refusals, accepted jobs keyed by case id, counts) over every base and mutation."""
    start = time.time()
    refused, accepted, tried, failures, hints = 0, {}, 0, [], 0
    for base_name, overrides in BASES.items():
        base = compose_job(overrides)
        assert not errors(validate(base)), base_name
        accepted[f"{base_name}:base"] = base
        for changes in _mutations(base):
            tried += 1
            job = _mutated(base, changes)
            case = f"{base_name}:" + " ".join(f"{n}={v!r}" for n, v in changes)
            try:
                problems = validate(job)
            except Exception as exc:  # noqa: BLE001
                failures.append(f"{case}: validate raised {type(exc).__name__}: {exc}")
                continue
            internal = [p.line() for p in problems if p.field == "config"]
            if internal:
                failures.append(f"{case}: {internal[0]}")
            if errors(problems):
                refused += 1
                if not _names_a_field(problems, changes):
                    failures.append(f"{case}: refused without naming the field: {[p.line() for p in errors(problems)]}")
                if len(changes) == 1:
                    hints += 1
                    failures += [f"{case}: {bad}" for bad in _invalid_alternatives(job, problems)]
            else:
                accepted[case] = job
    return {"refused": refused, "accepted": accepted, "tried": tried, "failures": failures,
            "login_s": time.time() - start, "hints": hints}


def _invalid_alternatives(job, problems) -> list[str]:
    """Printed override alternatives that do not remove their problem, or that add an error."""
    before = {problem_key(p) for p in errors(problems)}
    bad = []
    for problem in errors(problems):
        for alternative in problem.hint.split(" or "):
            pairs = hint_overrides(alternative)
            if not pairs:
                continue
            fixed = copy.deepcopy(job)
            for key, text in pairs:
                section, _, attr = key.rpartition(".")
                setattr(getattr(fixed, section) if section else fixed, attr, parse_value(key, text))
            after = {problem_key(p) for p in errors(raw_problems(fixed))}
            if problem_key(problem) in after or after - before:
                bad.append(f"{problem.line()} -> {alternative} leaves {sorted(after - before) or 'the problem'}")
    return bad


def test_login_side_never_raises_and_names_the_field(verdicts):
    print(f"\ndifferential: {verdicts['tried']} configurations, {verdicts['refused']} refused "
          f"(hints of {verdicts['hints']} re-validated), {len(verdicts['accepted'])} accepted, "
          f"login side {verdicts['login_s']:.1f} s")
    assert verdicts["tried"] >= 1000
    assert not verdicts["failures"], "\n".join(verdicts["failures"][:40])


PROBE_IDLE_S = 300
"""Hang detector of the probes: a probe that starts no new case for this long is stopped and reported, naming
its case. One case takes well under a second, except a first Inductor compile of the fused cross-entropy
(model.cross_entropy_loss_fusion=true): tens of CPU seconds, over a minute of wall time on a busy machine."""


def _wait_on_progress(procs, tmp_path) -> None:
    """Wait for every probe to end; stop them all and fail, naming the case, if one makes no progress (prints
    no new ``probe: case`` line) for PROBE_IDLE_S."""
    import threading

    last = [[time.monotonic(), "(starting: importing Megatron-Core)"] for _ in procs]

    def pump(i, proc):
        for line in proc.stdout:
            last[i] = [time.monotonic(), line.strip()]

    pumps = [threading.Thread(target=pump, args=(i, p), daemon=True) for i, p in enumerate(procs)]
    for t in pumps:
        t.start()
    while any(p.poll() is None for p in procs):
        stuck = [(i, what) for i, (p, (at, what)) in enumerate(zip(procs, last))
                 if p.poll() is None and time.monotonic() - at > PROBE_IDLE_S]
        if stuck:
            for p in procs:
                p.kill()
            i, what = stuck[0]
            err = (tmp_path / f"err{i}.txt").read_text(errors="replace")[-2000:]
            raise AssertionError(f"hang: Megatron-Core probe {i} made no progress for {PROBE_IDLE_S} s; it was "
                                 f"on {what}\n{err}")
        time.sleep(0.5)
    for t in pumps:
        t.join(timeout=10)


def test_what_the_login_node_accepts_megatron_core_builds(verdicts, tmp_path):
    unique: dict = {}
    for case, job in verdicts["accepted"].items():
        unique.setdefault(repr(job), (case, job))
    cases = list(unique.values())
    procs = []
    for shard in range(SHARDS):  # one probe process per core
        (tmp_path / f"cases{shard}.pkl").write_bytes(pickle.dumps(cases[shard::SHARDS]))
        # stderr to a file, not a pipe: Megatron warns once per model built, and a pipe read only after the
        # other shard has finished fills up and stalls this one (the shards then ran one after the other)
        with open(tmp_path / f"err{shard}.txt", "w") as err:
            procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "_mcore_probe.py"),
                                           str(tmp_path / f"cases{shard}.pkl"), str(tmp_path / f"out{shard}.json")],
                                          cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True))
    _wait_on_progress(procs, tmp_path)
    results, seconds, config_only, reused, unstepped = {}, 0.0, 0, 0, 0
    for shard, proc in enumerate(procs):
        assert proc.returncode == 0, (tmp_path / f"err{shard}.txt").read_text(errors="replace")[-3000:]
        out = json.loads((tmp_path / f"out{shard}.json").read_text())
        seconds, config_only = max(seconds, out.pop("__seconds__")), config_only + out.pop("__config_only__")
        out.pop("__slowest__")
        reused += out.pop("__reused__")
        unstepped += out.pop("__no_cxx_unstepped__")
        results.update(out)
    print(f"\ndifferential: {len(cases)} distinct accepted configurations through Megatron-Core in {seconds} s "
          f"({len(cases) - config_only} models built, {config_only} too large: config objects and groups only; "
          f"{reused} of them the same build as another, whose result they share)")
    if unstepped:
        print(f"differential: no C++ compiler ($CXX or g++): {unstepped} jobs with model.cross_entropy_loss_fusion="
              f"true built but not stepped (Inductor cannot compile the fused loss on this machine)")
    broken = [f"{case}: {error}" for case, error in results.items() if error]
    assert not broken, f"{len(broken)} accepted by validate but refused by Megatron-Core:\n" + "\n".join(broken[:60])
