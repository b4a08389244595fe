"""Fuzz the command line: seeded random overrides of every schema field (and group options) with hostile values,
through ``launcher.cli.main`` in-process with action=validate and action=plan. Whatever the input, the
launcher answers with an exit code (0, or 2 with ``error:`` lines; 1 only for a search that finds nothing) and
never a traceback or an internal validation error. The number of commands tried is printed (``pytest -s``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import random
import time

from launcher.cli import main
from launcher.schema import SECTIONS, JobConfig

RUNS = 200
"""Seeded commands per run (was 300; CI's 30-minute budget on 2 cores)."""
VALUES = ["0", "-1", "1", "2", "3", "7", "1.5", "-0.5", "1e309", "-1e309", "inf", "-inf", "nan", "null", "true",
          "false", "[]", "[1,2]", "[a]", "{}", "''", "abc", "1_000", "0x10", "99999999999999999999", "2147483648",
          "'a b'", "';rm -rf /'", "'%s%n'", "é", "x" * 300, "${oc.env:HOME}", "${nope}", "${oc.env:WANDB_API_KEY}",
          "'${oc.env:HF_TOKEN,x}'", "${model.hidden_size}", "[0.5,a,0.5]", "'1,2,3'", "00:00:01", "1-00:00:00"]
GROUPS = ["recipe=smoke", "recipe=llama3_8b", "recipe=llama3_70b", "recipe=llama405b", "cluster=h100",
          "cluster=h200", "cluster=local", "cluster=slurm_local", "model=deepseek_v3", "model=qwen3_30b_a3b",
          "+experiment=bf16", "+experiment=tiny", "data=mock"]


def _fields() -> list[str]:
    names = [f.name for f in dataclasses.fields(JobConfig) if f.name not in SECTIONS and f.name != "action"]
    for section, cls in SECTIONS.items():
        names += [f"{section}.{f.name}" for f in dataclasses.fields(cls)]
    return names


def _command(rng: random.Random, fields: list[str]) -> list[str]:
    if rng.random() < 0.5:  # one override on a recipe as it ships: mostly accepted, so plan runs on it
        return [rng.choice(GROUPS[:4]), f"{rng.choice(fields)}={rng.choice(VALUES)}"]
    argv = [rng.choice(GROUPS[:4])] + rng.sample(GROUPS[4:], rng.randint(0, 2))
    for _ in range(rng.randint(1, 3)):
        field = rng.choice(fields)
        value = rng.choice(VALUES)
        argv.append(f"{'+' if field.startswith('cluster.env') else ''}{field}={value}")
    if rng.random() < 0.1:
        argv.append(f"+cluster.env.X_{rng.randint(0, 9)}={rng.choice(VALUES)}")
    return argv


def test_fuzzed_overrides_never_crash(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a stray render would land here
    rng, fields = random.Random(11), _fields()
    counts = {"validate": 0, "plan": 0}
    outcomes: dict = {}
    crashes = []
    start = time.time()
    for i in range(RUNS):
        action = "validate" if i % 2 == 0 else "plan"
        argv = [*_command(rng, fields), f"action={action}"]
        out, err = io.StringIO(), io.StringIO()
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = main(argv)
        except BaseException as exc:  # noqa: BLE001
            crashes.append(f"{' '.join(argv)}: raised {type(exc).__name__}: {exc}")
            continue
        counts[action] += 1
        outcomes[code] = outcomes.get(code, 0) + 1
        text = out.getvalue() + err.getvalue()
        if "Traceback" in text or "could not be evaluated" in text:
            crashes.append(f"{' '.join(argv)}: {text[-600:]}")
        elif code == 2 and not err.getvalue().startswith(("error:", "warning:")):
            crashes.append(f"{' '.join(argv)}: exit 2 without an error line: {err.getvalue()[:300]!r}")
        elif code not in (0, 2):
            crashes.append(f"{' '.join(argv)}: exit {code}: {text[-300:]}")
    print(f"\nfuzz: {counts['validate']} action=validate + {counts['plan']} action=plan commands, exit codes "
          f"{dict(sorted(outcomes.items()))}, {time.time() - start:.1f} s")
    assert not crashes, "\n".join(crashes[:30])
