"""Each action of `python -m launcher` end to end (in-process): validate, plan, search, render, submit."""
from __future__ import annotations

import json
import os
import sys

from launcher.executor import SubmitError, parse_job_id

import pytest


def test_validate_prints_the_layout(cli):
    code, out, _ = cli("recipe=llama405b", "cluster=h200", "action=validate")
    assert code == 0
    assert "TP8 PP8 CP2 DP4" in out and "64x8 H200" in out


def test_plan_json_is_machine_readable(cli):
    code, out, _ = cli("recipe=llama405b", "cluster=h200", "action=plan", "--json")
    assert code == 0
    plan = json.loads(out)
    assert plan["fits"] is True and plan["peak_gb"] < plan["gpu_memory_gb"]
    assert abs(plan["gflops_per_token"] - 2523.96) / 2523.96 < 5e-4
    assert 0 < plan["mfu"] < 1


def test_search_ranks_fitting_layouts(cli):
    code, out, _ = cli("recipe=llama3_70b", "cluster=h100", "nodes=16", "action=search", "--json")
    assert code == 0
    results = json.loads(out)
    assert 1 <= len(results) <= 10
    speeds = [r["tokens_per_s"] for r in results]
    assert speeds == sorted(speeds, reverse=True)
    assert all(r["peak_gb"] <= r["gpu_memory_gb"] for r in results)
    code, out, _ = cli("recipe=llama3_70b", "cluster=h100", "nodes=16", "action=search")
    assert code == 0 and "top" in out and "why" in out


def test_oom_is_refused_before_rendering_unless_forced(cli, tmp_path):
    args = ("recipe=llama405b", "nodes=8", "parallel.pipeline=4", "parallel.context=1",
            "parallel.first_stage_layers=null", "parallel.last_stage_layers=null", "model.num_layers=128",
            f"output_dir={tmp_path}", "action=render")
    code, _, err = cli(*args)
    assert code == 2
    assert "out of memory" in err and "stage" in err
    assert list(tmp_path.iterdir()) == []
    code, _, _ = cli(*args, "force=true")
    assert code == 0 and len(list(tmp_path.iterdir())) == 1


def test_submit_calls_sbatch_and_records_the_job_id(cli, tmp_path, monkeypatch):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "sbatch").write_text('#!/bin/bash\necho "$@" > "$(dirname "$0")/args"\necho "4242;cluster"\n')
    (fake / "sbatch").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")
    out_dir = tmp_path / "runs"
    code, out, err = cli("recipe=llama3_8b", "action=submit", f"output_dir={out_dir}")
    assert code == 0, err
    bundle = next(out_dir.iterdir())
    assert json.loads((bundle / "submission.json").read_text()) == {"job_id": "4242"}
    assert (fake / "args").read_text().split() == ["--parsable", str(bundle / "job.sbatch")]
    assert "submitted: job 4242" in out


def test_submit_without_slurm_says_so(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    code, _, err = cli("recipe=llama3_8b", "action=submit", f"output_dir={tmp_path / 'runs'}")
    assert code == 1 and "sbatch not found" in err and "Traceback" not in err


@pytest.mark.parametrize("text,expected", [("123\n", "123"), ("123;cluster\n", "123"),
                                           ("Submitted batch job 77\n", "77")])
def test_parse_job_id(text, expected):
    assert parse_job_id(text) == expected


def test_parse_job_id_refuses_garbage():
    with pytest.raises(SubmitError):
        parse_job_id("sbatch: error: invalid partition\n")


def _counted(monkeypatch, fn) -> list:
    """Every binding of ``fn`` in the project's loaded modules replaced by a wrapper that records its first
    argument (a module that imported the name holds its own binding)."""
    calls = []

    def counting(*args, **kwargs):
        calls.append(args[0] if args else next(iter(kwargs.values())))
        return fn(*args, **kwargs)
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").partition(".")[0] in ("launcher", "data", "models"):
            for name, value in list(vars(module).items()):
                if value is fn:
                    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("args", [("recipe=smoke", "action=validate"), ("recipe=smoke", "action=plan"),
                                  ("recipe=smoke", "action=render"), ("recipe=smoke", "action=megatron-args"),
                                  ("recipe=llama3_8b", "action=render"), ("recipe=smoke", "action=search")])
def test_the_cli_validates_and_derives_a_job_once(cli, tmp_path, monkeypatch, args):
    """The CLI hands the job it validated and its Layout on (launcher.validate.Checked): no action validates or
    derives that job again (the hint search and the layout search derive other jobs, copies with changes)."""
    import launcher.actions, launcher.megatron_lm.translate, launcher.plan.pictures, launcher.plan.search  # noqa: F401
    import launcher.render  # noqa: F401  -- loaded first, so that their own bindings are counted too
    from launcher.core import layout
    from launcher.validate import sections

    rules, derived = _counted(monkeypatch, sections.run_rules), _counted(monkeypatch, layout.derive)
    code, _, err = cli(*args, f"output_dir={tmp_path}")
    assert code == 0, err
    job = rules[0]
    assert sum(j is job for j in rules) == 1, "validated again"
    assert sum(j is job for j in derived) == 1, f"derived {sum(j is job for j in derived)} times"


def _table_lines_are_whole(out: str) -> None:
    """Every line of a printed table ends in its border: rich crops a line wider than the console silently."""
    rows = [line for line in out.splitlines() if line[:1] in "┏┃┡│└"]
    assert rows, out
    cut = [line for line in rows if line.rstrip()[-1:] not in "┓┃┩│┘"]
    assert not cut, "cropped:\n" + "\n".join(cut[:5])


def test_search_table_shows_each_override_whole_as_typed(cli):
    """The table's overrides are what the user types: a list value ([attn,moe_router,...], which rich would read as
    a style tag and drop) printed as is, one override a line, no line cropped; the same overrides as --json."""
    from launcher.actions import _changed
    from launcher.config import compose_job

    args = ("recipe=qwen3_30b_a3b", "action=search")
    code, out, _ = cli(*args, "--json")
    assert code == 0
    job = compose_job(["recipe=qwen3_30b_a3b"])
    typed = [o for r in json.loads(out) for o in _changed(job, r["overrides"])]
    assert any("=[" in o and not o.endswith("=[]") for o in typed), "no list-valued override to show"
    code, out, _ = cli(*args)
    assert code == 0
    cells = {cell.strip() for line in out.splitlines() for cell in line.split("│")}
    missing = [o for o in typed if o not in cells]
    assert not missing, f"not shown whole on a line of its own: {missing}\n{out}"
    _table_lines_are_whole(out)


def test_plan_table_prints_names_and_warnings_as_data_not_markup():
    """A warning's hint such as train.cuda_graph_modules=[attn] reaches the plan's text whole."""
    import dataclasses

    from launcher.config import compose_job
    from launcher.plan import plan_job

    plan = plan_job(compose_job(["recipe=smoke"]))
    hint = "warning: train.x=1: a made-up rule; try train.cuda_graph_modules=[attn,moe_router] or [bold]"
    text = dataclasses.replace(plan, warnings=[hint], name="smoke[red]x").text(width=400)
    assert hint in text and "smoke[red]x" in text, text
