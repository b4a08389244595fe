"""The pre-run checks (launcher/preflight.py): one ordered table per action, each row still run for its actions,
the stage rule of the runner, and the plan and signal lead derived once per command."""
from __future__ import annotations

import json

import pytest

from launcher import preflight
from launcher.preflight import CHECKS, Check, Preflight, rows_for, run_checks
from launcher.problems import Problem
from launcher.schema import ACTIONS

LAUNCH = ["checkpoint dir writable", "checkpoint dir is no checkpoint", "checkpoint.load exists",
          "predicted out of memory", "signal lead", "explicit timeouts"]
RUN = ["rank-side limits", "data and token budget", *LAUNCH, "Hugging Face start", "resume plan"]
EXPECTED = {"validate": RUN, "render": RUN, "submit": RUN, "run": RUN, "plan": ["resume plan"],
            "search": [], "list": [], "bench": ["data and token budget"],
            "megatron-args": ["data and token budget"]}
"""Each action's checks in the order they ran before the table existed (launcher/cli.py's chain of ifs)."""


def test_each_action_runs_its_checks_in_order():
    assert sorted(EXPECTED) == sorted(a for a in ACTIONS if a != "default")  # a new action must be placed here
    for action, names in EXPECTED.items():
        assert [row.name for row in rows_for(action)] == names, action


def test_the_table_is_well_formed():
    names = [row.name for row in CHECKS]
    assert len(set(names)) == len(names)
    for row in CHECKS:
        assert row.why and set(row.actions) <= set(ACTIONS) - {"default"}, row.name
    stages = [row.stage for row in CHECKS]
    # a stage's rows are adjacent: the runner opens a stage once, when its first row comes up
    assert all(stages.index(s) == i or stages[i - 1] == s for i, s in enumerate(stages)), stages
    assert [r.name for r in CHECKS if r.stage == "launch"] == LAUNCH  # render's refusals reported together


def _row(name, stage, found, calls, actions=("validate",)):
    def run(ctx):
        calls.append(name)
        return [Problem(name, 1, "rule", "hint", severity=s) for s in found]
    return Check(name, actions, stage, run, "why")


def test_runner_self_test_order_actions_and_stages():
    """Rows run in table order for their actions only; a stage opens only when nothing before it is an error, and
    every row of an opened stage runs (their problems are reported together)."""
    calls: list[str] = []
    table = (_row("a", "one", ["warning"], calls), _row("skip", "one", ["error"], calls, actions=("plan",)),
             _row("b", "two", ["error"], calls), _row("c", "two", ["error"], calls), _row("d", "three", [], calls))
    ctx = run_checks(Preflight(job=None, action="validate", layout=None), table)
    assert calls == ["a", "b", "c"]
    assert [(p.field, p.severity) for p in ctx.problems] == [("a", "warning"), ("b", "error"), ("c", "error")]
    calls.clear()
    ctx = run_checks(Preflight(job=None, action="plan", layout=None), table)
    assert calls == ["skip"] and [p.field for p in ctx.problems] == ["skip"]


def _cli(cli, *args):
    code, out, err = cli(*args)
    return code, [line.split("=", 1)[0] for line in err.splitlines() if line.startswith("error: ")]


H100 = ["recipe=llama3_8b", "cluster=h100"]


@pytest.mark.parametrize("row, overrides, field", [
    ("data and token budget", ["recipe=smoke", "data.blend=[/nonexistent/x]"], "error: data.blend[0]"),
    ("checkpoint dir writable", ["recipe=smoke", "checkpoint.dir=/proc/nope"], "error: checkpoint.dir"),
    ("checkpoint dir is no checkpoint", ["recipe=smoke", "checkpoint.dir={tmp}/iter_0000004"], "error: checkpoint.dir"),
    ("checkpoint.load exists", ["recipe=smoke", "checkpoint.load=/nonexistent/ckpt"], "error: checkpoint.load"),
    ("predicted out of memory", [*H100, "train.micro_batch_size=16"], "error: force"),
    ("signal lead", [*H100, "slurm.time=00:05:00"], "error: slurm.time"),
    ("explicit timeouts", [*H100, "timeouts.collective_s=1"], "error: timeouts.collective_s"),
])
@pytest.mark.parametrize("action", ["validate", "render"])
def test_every_row_still_refuses_for_validate_and_render(cli, tmp_path, row, overrides, field, action):
    """Each check that ran before the table still runs for the actions that prepare a run (validate says what
    render would refuse), and only its line is reported."""
    (tmp_path / "iter_0000004").mkdir()
    (tmp_path / "iter_0000004" / "metadata.json").write_text("{}")
    args = [o.replace("{tmp}", str(tmp_path)) for o in overrides]
    code, fields = _cli(cli, *args, f"action={action}", f"output_dir={tmp_path / 'runs'}")
    assert code == 2 and fields == [field], (row, fields)
    assert not list(tmp_path.glob("runs/*/config.yaml"))  # refused before anything renders


@pytest.mark.parametrize("action, imports", [("validate", False), ("render", True), ("plan", None)])
def test_the_hugging_face_start_runs_for_the_actions_that_prepare_a_run(cli, tmp_path, monkeypatch, action, imports):
    """checkpoint.load_hf: compared (validate) or imported (render) through import-hf (tests/test_hf_load.py runs the
    real one); here its stand-in records how it was called and refuses, as a differing config.json does."""
    calls = []

    def stand_in(job, *, import_weights, layout=None):
        calls.append(import_weights)
        return job, [Problem("model.num_layers", 4, "the HF config.json has num_hidden_layers=2", "model.num_layers=2")]

    monkeypatch.setattr(preflight, "hf_start", stand_in)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")
    code, fields = _cli(cli, "recipe=smoke", f"checkpoint.load_hf={tmp_path / 'hf'}", f"action={action}",
                        f"output_dir={tmp_path / 'runs'}")
    assert calls == ([] if imports is None else [imports])
    assert (code, fields) == ((0, []) if imports is None else (2, ["error: model.num_layers"]))


def test_launch_rows_report_together_and_stop_the_later_stages(cli, tmp_path, monkeypatch):
    """Stage rule end to end: a missing checkpoint.load and a short time limit are one stage (both said); a missing
    data file stops the stages after it (no checkpoint line), and the resume plan runs for plan as well."""
    code, fields = _cli(cli, *H100, "slurm.time=00:05:00", "checkpoint.load=/nonexistent/ckpt", "action=validate")
    assert code == 2 and fields == ["error: checkpoint.load", "error: slurm.time"]
    code, fields = _cli(cli, "recipe=smoke", "data.blend=[/nonexistent/x]", "checkpoint.load=/nonexistent/ckpt",
                        "action=validate")
    assert code == 2 and fields == ["error: data.blend[0]"]
    import launcher.resume_plan
    refused = Problem("checkpoint.load", "x", "refused by the resume plan", "checkpoint.load=null")
    monkeypatch.setattr(launcher.resume_plan, "problems_for", lambda job, lay: [refused])
    for action, said in (("plan", True), ("validate", True), ("search", False)):
        code, fields = _cli(cli, "recipe=smoke", f"action={action}", f"output_dir={tmp_path}")
        assert (fields == ["error: checkpoint.load"]) == said, (action, fields)


@pytest.fixture
def counted(monkeypatch):
    """Counts of the planner's entry and the signal-lead derivation during one command."""
    import launcher.core.signal_lead as signal_lead
    import launcher.plan as plan
    import launcher.render as render

    counts = {"plan": 0, "lead": 0}
    plan_job, lead_for_render = plan.plan_job, signal_lead.lead_for_render

    def counted_plan(*a, **k):
        counts["plan"] += 1
        return plan_job(*a, **k)

    def counted_lead(*a, **k):
        counts["lead"] += 1
        return lead_for_render(*a, **k)

    monkeypatch.setattr(plan, "plan_job", counted_plan)
    monkeypatch.setattr(signal_lead, "lead_for_render", counted_lead)
    monkeypatch.setattr(render, "lead_for_render", counted_lead)  # render imports the name
    return counts


SLURM = ["recipe=llama405b", "cluster=h200", "nodes=64"]


@pytest.mark.parametrize("base, action, plans, leads", [
    (SLURM, "render", 1, 1), (["recipe=smoke"], "render", 1, 1), (SLURM + ["slurm.signal_lead_s=900"], "render", 1, 1),
    (SLURM, "validate", 1, 1), (["recipe=smoke"], "validate", 1, 1), (SLURM, "plan", 1, 0),
    ([*H100, "train.micro_batch_size=16"], "validate", 1, 1),  # a predicted OOM: its details read the same plan
])
def test_a_command_plans_once_and_derives_its_signal_lead_once(cli, counted, tmp_path, base, action, plans, leads):
    cli(*base, f"action={action}", f"output_dir={tmp_path}")
    assert (counted["plan"], counted["lead"]) == (plans, leads)


def test_the_bundle_holds_the_lead_and_plan_the_checks_derived(cli, tmp_path, monkeypatch):
    """Render writes what the table derived, not a second derivation: the context's lead (marked here) is the one
    meta.json records and job.sbatch signals at."""
    lead_of = Preflight.signal_lead

    def marked(self):
        return {**lead_of(self), "marked": True}

    monkeypatch.setattr(Preflight, "signal_lead", marked)
    code, _, _ = cli(*SLURM, "action=render", f"output_dir={tmp_path}")
    assert code == 0
    (bundle,) = tmp_path.glob("llama405b-*")
    lead = json.loads((bundle / "meta.json").read_text())["signal_lead"]
    assert lead["marked"] and f"#SBATCH --signal=B:USR1@{lead['seconds']}" in (bundle / "job.sbatch").read_text()


def test_the_front_door_imports_the_megatron_lm_commands_from_their_module():
    """launcher/megatron_lm/__init__.py is a face that imports nothing (a hint or a command loads only its own
    module); the two commands live in megatron_lm/commands.py."""
    import ast
    from pathlib import Path

    import launcher.megatron_lm as face
    from launcher.megatron_lm import commands

    tree = ast.parse(Path(face.__file__).read_text())
    assert all(isinstance(node, ast.Expr) or isinstance(node, ast.ImportFrom) and node.module == "__future__"
               for node in tree.body)
    assert callable(commands.import_main) and callable(commands.do_megatron_args)
    assert preflight.__name__ == "launcher.preflight"
