"""tests/README.md: the rooms of the product and, for each, the test modules that import it or name its files.\n\n``python tests/_test_map.py > tests/README.md``; tests/test_docs.py checks the file is what this prints."""
import ast
import os
import re
import textwrap
from collections import defaultdict
from pathlib import Path

os.chdir(Path(__file__).resolve().parents[1])  # paths below are the repository's
HEAD = "# The tests, room by room\n\n`make test` runs all of them (two at a time, `pytest -n 2 --dist loadgroup`); `make test-fast` leaves out the\nlanes `tests/conftest.py` marks from what a test does: `multirank` (starts ranks), `slurm` (talks to the real\none-node Slurm, `slurm/localhost/start.sh`), `gpu` (needs CUDA: `tests/gpu/`, the GPU lane) and `slow`. The Slurm\ntests share one xdist worker (one cluster per session), the users of the session's `reference_run` another.\n\nFiles: `test_*.py` are the tests; `_*.py` are their helpers (`_rank_harness.py` writes bundles and starts ranks,\n`_rank_zygote.py` forks pre-imported ranks, `_*_worker.py` are the bodies multi-rank tests run on every rank,\n`_mcore_probe.py` builds what the ranks build for the differential test, `_nccl_emulation.py` holds gloo to NCCL's\nrules); `golden/` and `fixtures/` their data. House rules are tests too: `test_layering.py` (the wings, the rooms,\none build sequence, short functions), `test_named_literals.py`, `test_no_timing_asserts.py`, `test_wiring.py`.\n\n## Where a product file's tests are\n\nEach room of the product and the test modules that import it or name its files: a static reading (the schema and\n`compose_job`, which nearly every test uses, are left out; a test that only runs `python -m launcher` is not\nlisted). `tests/test_docs.py` checks this list is current: regenerate it with\n`python tests/_test_map.py > tests/README.md`.\n\n"
ROOMS = [  # (room, product path prefixes)
    ("front door: CLI, overrides, actions, pre-run checks (login)", ["launcher/overrides.py", "launcher/fields.py", "launcher/cli.py", "launcher/__main__.py", "launcher/help.py", "launcher/problems.py", "launcher/actions.py", "launcher/preflight.py", "launcher/catalog.py"]),
    ("validation (login)", ["launcher/validate/"]),
    ("planner and search (login)", ["launcher/plan/", "launcher/calibration.py"]),
    ("render, submit, runs (login)", ["launcher/render.py", "launcher/executor.py", "launcher/runs.py", "launcher/run_state.py", "launcher/slurm_tool.py", "launcher/resume_plan.py", "launcher/data_preflight.py", "slurm/"]),
    ("Megatron-LM import/export (login)", ["launcher/megatron_lm/"]),
    ("core: layout, wiring, identity, timeouts", ["launcher/core/layout.py", "launcher/core/wiring.py", "launcher/core/run_identity.py", "launcher/core/timeouts.py", "launcher/core/signal_lead.py", "launcher/core/time_limit.py", "launcher/core/flops.py", "launcher/core/paths.py", "launcher/core/cuda_env.py", "launcher/core/determinism.py", "launcher/core/blend.py", "launcher/core/jobfile.py", "launcher/core/indexed_files.py", "launcher/core/tokenizer_file.py"]),
    ("checkpoints (core/checkpoint, rank/checkpoint)", ["launcher/core/checkpoint/", "launcher/rank/checkpoint/", "launcher/checkpoint_state.py"]),
    ("pipeline schedules (core/pipeline, rank/zb_executor, models/deferred_wgrad)", ["launcher/core/pipeline/", "launcher/rank/zb_executor.py", "models/deferred_wgrad.py"]),
    ("rank: entry, training, loop, data, forensics", ["launcher/rank/"]),
    ("models (GPTModel build, Transformer Engine seam, CPU bridge)", ["models/"]),
    ("Hugging Face in and out (tool)", ["launcher/hf/"]),
    ("data preprocessor (tool)", ["data/"]),
]
def room_of(f):
    for name, prefixes in ROOMS:
        if any(f == p or (p.endswith("/") and f.startswith(p)) for p in prefixes):
            return name
    return None
out = defaultdict(set)
for t in sorted(Path("tests").glob("test_*.py")):
    src = t.read_text()
    mods = set()
    for n in ast.walk(ast.parse(src)):
        if isinstance(n, ast.ImportFrom) and n.module and not n.level:
            mods.add(n.module); mods.update(f"{n.module}.{a.name}" for a in n.names)
        elif isinstance(n, ast.Import):
            mods.update(a.name for a in n.names)
    files = set(re.findall(r"(?:launcher|models|data|slurm)/[\w/]+\.(?:py|j2|sh)", src))
    for m in mods:
        parts = m.split(".")
        if parts[0] not in ("launcher", "models", "data"): continue
        for k in range(len(parts), 0, -1):
            p = Path(*parts[:k])
            if p.with_suffix(".py").is_file(): files.add(str(p.with_suffix(".py"))); break
            if (p / "__init__.py").is_file(): files.add(str(p / "__init__.py")); break
    rooms = {room_of(f) for f in files} - {None}
    for r in rooms: out[r].add(t.name)
def readme() -> str:
    """tests/README.md: the fixed text, then each room's tests."""
    lines = [HEAD.rstrip("\n"), ""]
    for name, _ in ROOMS:
        tests = ", ".join(f"`{x[5:-3]}`" for x in sorted(out.get(name, ()))) or "(none)"
        lines.append(f"- **{name}**:")
        lines += textwrap.wrap(tests, 116, initial_indent="  ", subsequent_indent="  ")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(readme(), end="")
