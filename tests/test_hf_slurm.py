"""``import-hf`` / ``export-hf`` with ``--slurm`` (issue 42; launcher/slurm_tool.py): the job bundle it renders (the
sbatch script run for real with stand-ins, hostile paths passed through literally), its refusals (one line each), its
memory bound against the converter's own, and one tiny import through the real local Slurm whose checkpoint is
byte-identical to a local import-hf's."""
from __future__ import annotations

import json
import os
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from _hf_tiny import NAMES, overrides
from conftest import ROOT
from launcher import slurm_tool
from launcher.config import compose_job

LLAMA = overrides("llama")


def fake_hf(root: Path, shapes: dict, dtype: str = "F32") -> Path:
    """An HF directory as the login side reads it: config.json and a safetensors file's JSON header (the login side
    reads no tensor bytes, so none are written); no torch needed."""
    root.mkdir(parents=True)
    (root / "config.json").write_text("{}")
    header, at = {}, 0
    for name, shape in shapes.items():
        size = slurm_tool.ITEMSIZE[dtype]
        for dim in shape:
            size *= dim
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [at, at + size]}
        at += size
    raw = json.dumps(header).encode()
    (root / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    return root


def stand_ins(tmp_path: Path, *, sinfo_mb: str = "64000", sbatch: bool = True) -> dict:
    """PATH with stand-ins for sbatch (records its argv, answers a job id) and sinfo (one node of ``sinfo_mb``)
    in front of the real tools (a temporary directory: conftest's lane guard knows them); ``sbatch=False``: none
    (``cli`` then hides the real one too)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    tools = {"sinfo": f"echo {sinfo_mb}\n"}
    if sbatch:
        tools["sbatch"] = f'printf "%s\\n" "$@" > {shlex.quote(str(tmp_path / "sbatch.argv"))}\necho 4242\n'
    for name, body in tools.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": os.pathsep.join([str(bin_dir), os.environ["PATH"]]), "NO_SBATCH": str(not sbatch)}


def cli(monkeypatch, capsys, env: dict, *argv: str) -> tuple:
    """``python -m launcher import-hf|export-hf ...`` in this process: (exit code, stdout, stderr)."""
    import shutil

    from launcher.hf import main

    monkeypatch.setenv("PATH", env["PATH"])
    if env["NO_SBATCH"] == "True":  # a machine without Slurm's client
        which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "sbatch" else which(name, *a, **k))
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


TINY = {"model.embed_tokens.weight": (200, 64), "lm_head.weight": (200, 64)}


def expected_mem_mb(elements: int, hf_item: int = 4, job_item: int = 4) -> int:
    """--mem as the stated bound says, computed here from the rule (docs/hugging-face.md), not from the code."""
    bound = 2**30 + elements * (hf_item + 2 * max(hf_item, job_item)) + 128 * 2**20
    return -(-int(bound * 1.25) // 2**20)


# ---- the bundle ------------------------------------------------------------------------------------------------

def test_import_renders_a_one_node_job_that_runs_the_same_import_without_slurm(tmp_path, monkeypatch, capsys):
    hf = fake_hf(tmp_path / "hf", {"model.embed_tokens.weight": (128000, 64)}, dtype="BF16")
    env = stand_ins(tmp_path)
    monkeypatch.chdir(tmp_path)
    code, out, err = cli(monkeypatch, capsys, env, "import-hf", "--hf", "hf", "--output", "ckpt", *LLAMA,
                         "model.vocab_size=128000", "cluster=slurm_local", "cluster.partition=cpu",
                         "slurm.time=00:20:00", "--max-memory", "2GB", "--slurm")
    assert code == 0, err
    (bundle,) = (tmp_path / "runs").glob("import-hf-*")
    assert f"bundle: {bundle}\n" in out and "submitted: job 4242 (import-hf, 1 node" in out, out
    assert f"python -m launcher status {bundle}" in out and f"python -m launcher logs {bundle} --follow" in out
    assert (tmp_path / "sbatch.argv").read_text().split() == ["--parsable", str(bundle / "job.sbatch")]
    script = (bundle / "job.sbatch").read_text()
    directives = re.findall(r"^#SBATCH (.*)$", script, re.MULTILINE)
    # the vocabulary (128000 rows of 64, a multiple of 64) is the largest tensor: bf16 HF bytes, an fp32 job
    mem = expected_mem_mb(128000 * 64, hf_item=2, job_item=4)
    assert directives == ["--job-name=import-hf", "--nodes=1", "--ntasks=1", f"--mem={mem}M",
                          "--time=00:20:00", "--partition=cpu", "--no-requeue", "--open-mode=append",
                          f"--output={bundle}/logs/slurm-%j.out"], script
    assert "gpu" not in " ".join(directives)
    step = ["import-hf", "--hf", str(hf), "--output", str(tmp_path / "ckpt"), "--config", str(bundle / "config.yaml"),
            "--max-memory", "2GB"]
    assert f"-m launcher {shlex.join(step)} || status=$?" in script, script
    assert json.loads((bundle / "tool.json").read_text())["argv"] == step
    assert "export OMP_NUM_THREADS=1" in (bundle / "env.sh").read_text()  # the profile's environment
    from launcher.core import load_job

    ours = compose_job([*LLAMA, "model.vocab_size=128000", "cluster=slurm_local"]).model
    assert load_job(bundle / "config.yaml").model == ours  # the job the step imports with
    assert json.loads((bundle / "submission.json").read_text()) == {"job_id": "4242"}


HOSTILE = ["$(touch {sentinel})", "`touch {sentinel}`", "a; touch {sentinel}", "line1\ntouch {sentinel}",
           "it's \"quoted\" $HOME \\ & | > <"]


@pytest.mark.parametrize("template", HOSTILE)
def test_hostile_paths_reach_the_step_literally(template, tmp_path, monkeypatch, capsys):
    """The rendered job.sbatch run with stand-ins for srun (runs its command) and the profile's python (records its
    argv): the hostile --hf and --output paths arrive as one argument each, and nothing in them runs."""
    sentinel = tmp_path / "PWNED"
    value = template.format(sentinel=sentinel)
    hf = fake_hf(tmp_path / value / "hf", TINY)
    out = tmp_path / value / "out"
    recorded = tmp_path / "python.argv"
    python = tmp_path / "bin" / "python"
    env = stand_ins(tmp_path)
    python.write_text(f'#!/bin/bash\nprintf "%s\\0" "$@" > {shlex.quote(str(recorded))}\nexit 3\n')
    python.chmod(0o755)
    (tmp_path / "bin" / "srun").write_text('#!/bin/bash\nwhile [[ "$1" == --* ]]; do shift; done\n"$@"\n')
    (tmp_path / "bin" / "srun").chmod(0o755)
    code, _, err = cli(monkeypatch, capsys, env, "import-hf", "--hf", str(hf), "--output", str(out), *LLAMA,
                       "cluster=slurm_local", f"cluster.python={python}", f"output_dir={tmp_path / 'runs'}",
                       "--slurm")
    assert code == 0, err
    (bundle,) = (tmp_path / "runs").glob("import-hf-*")
    run = subprocess.run(["bash", str(bundle / "job.sbatch")], capture_output=True, text=True, timeout=60,
                         env={**env, "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node0"})
    assert run.returncode == 3, run.stdout + run.stderr  # the step's code is the job's
    assert not sentinel.exists(), "a hostile path was executed"
    step = ["import-hf", "--hf", str(hf), "--output", str(out), "--config", str(bundle / "config.yaml")]
    assert recorded.read_bytes().split(b"\0")[:-1] == [os.fsencode(a) for a in ["-m", "launcher", *step]]
    assert (bundle / "EXIT_CODE").read_text() == "3\n"


def test_export_renders_its_bound_from_the_checkpoint_manifest(tmp_path, monkeypatch, capsys):
    ckpt = tmp_path / "ckpts" / "iter_0000030"
    ckpt.mkdir(parents=True)
    (ckpt / "metadata.json").write_text("{}")
    model = compose_job(LLAMA).model
    (ckpt / "launcher.json").write_text(json.dumps({
        "step": 30, "files": {"metadata.json": {"size": 2}}, "padded_vocab": 64000, "dtype": "bf16",
        "identity": {f"model.{k}": v for k, v in vars(model).items()}}))
    env = stand_ins(tmp_path)
    code, out, err = cli(monkeypatch, capsys, env, "export-hf", "--checkpoint", str(ckpt.parent), "--output",
                         str(tmp_path / "hf"), "cluster=slurm_local", f"output_dir={tmp_path / 'runs'}", "--slurm")
    assert code == 0, err
    (bundle,) = (tmp_path / "runs").glob("export-hf-*")
    script = (bundle / "job.sbatch").read_text()
    # 3 x the largest tensor (the manifest's 64000 padded rows x 64, in its bf16) + start-up + margin, + 25%
    mem = -(-int((2**30 + 3 * 64000 * 64 * 2 + 128 * 2**20) * 1.25) // 2**20)
    assert f"#SBATCH --mem={mem}M\n" in script, script
    step = ["export-hf", "--checkpoint", str(ckpt), "--output", str(tmp_path / "hf")]  # the newest, resolved here
    assert f"-m launcher {shlex.join(step)} || status=$?" in script, script
    assert not (bundle / "config.yaml").exists()


# ---- refusals: one line each, nothing submitted -----------------------------------------------------------------

def _refusals(tmp_path: Path) -> dict:
    hf = fake_hf(tmp_path / "hf", TINY)
    taken = tmp_path / "taken"
    (taken / "iter_0000000").mkdir(parents=True)
    (tmp_path / "a-file").write_text("")
    base = ["import-hf", "--hf", str(hf), "--output", str(tmp_path / "out"), *LLAMA]
    return {
        "local profile": ([*base, "--slurm"], {},
                          "error: cluster=local: --slurm needs a Slurm cluster profile (cluster.launcher=slurm, not "
                          "local); try cluster="),
        "no sbatch": ([*base, "cluster=slurm_local", "--slurm"], {"sbatch": False},
                      "error: --slurm: sbatch is not on PATH; run this on the cluster's Slurm login node, or drop "
                      "--slurm to convert here"),
        "node too small": ([*base, "cluster=slurm_local", "--slurm"], {"sinfo_mb": "1000"},
                           f"error: --slurm: the conversion needs --mem={expected_mem_mb(256 * 64)}M ("),
        "no hf": (["import-hf", "--hf", str(tmp_path / "nowhere"), "--output", str(tmp_path / "out"), *LLAMA,
                   "cluster=slurm_local", "--slurm"], {},
                  f"error: --hf {tmp_path / 'nowhere'}: no config.json there"),
        "output taken": (["import-hf", "--hf", str(hf), "--output", str(taken), *LLAMA, "cluster=slurm_local",
                          "--slurm"], {}, f"error: --output {taken}: {taken / 'iter_0000000'} exists already; "
                                          "choose a new directory"),
        "output unwritable": (["import-hf", "--hf", str(hf), "--output", str(tmp_path / "a-file" / "out"), *LLAMA,
                               "cluster=slurm_local", "--slurm"], {},
                              f"error: --output {tmp_path / 'a-file' / 'out'}: "),
        "export model overrides": (["export-hf", "--checkpoint", str(taken), "--output", str(tmp_path / "x"),
                                    "model.hidden_size=8", "cluster=slurm_local", "--slurm"], {},
                                   "error: export-hf --slurm: model.hidden_size=8: only the job's cluster="),
    }


@pytest.mark.parametrize("case", ["local profile", "no sbatch", "node too small", "no hf", "output taken",
                                  "output unwritable", "export model overrides"])
def test_refusals_are_one_line_and_submit_nothing(case, tmp_path, monkeypatch, capsys):
    argv, env_kw, start = _refusals(tmp_path)[case]
    code, out, err = cli(monkeypatch, capsys, stand_ins(tmp_path, **env_kw), *argv)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith(start), err
    assert "try " in lines[0] or "choose " in lines[0] or "drop " in lines[0], lines[0]  # an alternative
    assert not (tmp_path / "sbatch.argv").exists() and not list(tmp_path.glob("runs/*")) and out == ""


def test_the_login_side_never_imports_torch(tmp_path):
    """``python -m launcher import-hf ... --slurm`` in a process where importing torch fails: it still submits."""
    hf = fake_hf(tmp_path / "hf", TINY)
    env = stand_ins(tmp_path)
    probe = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = ['launcher', *sys.argv[1:]]; "
             "runpy.run_module('launcher', run_name='__main__')")
    argv = ["import-hf", "--hf", str(hf), "--output", str(tmp_path / "out"), *LLAMA, "cluster=slurm_local",
            f"output_dir={tmp_path / 'runs'}", "--slurm"]
    proc = subprocess.run([sys.executable, "-c", probe, *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "submitted: job 4242" in proc.stdout, proc.stdout + proc.stderr


# ---- the bound against the converter's own -----------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_the_bound_covers_the_importers_largest_tensor_group(name, tmp_path, megatron_in_process):  # noqa: F811
    """The login side's bound, from the model entry alone, against what import-hf's plan says its largest tensor
    group is (launcher/hf/importer.py), and the largest-tensor rule against the built model's tensors: equal for
    the architecture as it is, and with its FFN, experts or attention made the largest in turn."""
    from _hf_tiny import save_random
    from launcher.core import derive
    from launcher.hf import importer

    save_random(name, tmp_path / "hf")
    job = compose_job(overrides(name))
    plan = importer.plan_fill(importer.build_meta(job), importer.HFTensors(tmp_path / "hf"), job.model)
    bound = slurm_tool.import_bound(job, slurm_tool.safetensors_itemsize(tmp_path / "hf"))
    assert plan.largest_group[0] + importer.MEMORY_MARGIN <= bound.bytes - slurm_tool.STARTUP_BYTES, (plan, bound)
    grow = {"ffn": ["model.ffn_hidden_size=2048"],
            "attention": ["model.num_attention_heads=64", "model.kv_channels=128"]}
    if job.model.num_experts:
        grow["experts"] = ["model.moe_ffn_hidden_size=2048"]
    if job.model.multi_latent_attention:
        grow["attention"] = ["model.num_attention_heads=64", "model.kv_lora_rank=1024", "model.q_lora_rank=1024"]
    for extra in [[], *grow.values()]:
        variant = compose_job([*overrides(name), *extra])
        built = max(t.numel() for t in importer.targets_of(importer.build_meta(variant)).values())
        assert slurm_tool.largest_tensor_elements(variant.model, derive(variant).padded_vocab) == built, (name, extra)


from test_hf import megatron_in_process  # noqa: E402,F401 - a fixture


# ---- through the real local Slurm --------------------------------------------------------------------------------

from test_slurm_localhost import PROFILE, Job, slurm  # noqa: E402,F401  (the cluster fixture)


def test_import_hf_through_slurm_writes_the_checkpoint_a_local_import_writes(slurm, tmp_path, megatron_in_process):
    """A tiny Llama imported as a Slurm job (``--slurm`` on the slurm_local profile) while the same import runs here:
    the job completes, ``status`` says done, and every file of its checkpoint but the save's own metadata
    (``.metadata`` names the save's path, ``launcher.json`` its time) is byte-identical to the local one's."""
    from _hf_tiny import save_random
    from launcher.hf import main
    from launcher.render import Bundle

    save_random("llama", tmp_path / "hf")
    command = ["import-hf", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "slurm"), *LLAMA]
    proc = subprocess.run([sys.executable, "-m", "launcher", *command, *PROFILE, f"output_dir={tmp_path / 'runs'}",
                           "slurm.time=00:10:00", "--slurm"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = re.search(r"^submitted: job (\d+)", proc.stdout, re.MULTILINE).group(1)
    (bundle,) = (tmp_path / "runs").glob("import-hf-*")
    with Job(Bundle(bundle), job_id) as job:
        assert main(["import-hf", "--hf", str(tmp_path / "hf"), "--output", str(tmp_path / "local"), *LLAMA]) == 0
        info = job.wait(180)
    log = (bundle / "logs" / f"slurm-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", f"{info}\n{log}"
    assert "import-report " in log and f"-> {tmp_path / 'slurm' / 'iter_0000000'}" in log, log
    from launcher.runs import read_tool

    assert read_tool(bundle)["state"] == "done"
    local, remote = tmp_path / "local" / "iter_0000000", tmp_path / "slurm" / "iter_0000000"
    names = sorted(p.name for p in local.iterdir())
    assert names == sorted(p.name for p in remote.iterdir()) and any(n.endswith(".distcp") for n in names), names
    for name in names:
        if name not in (".metadata", "launcher.json"):
            assert (local / name).read_bytes() == (remote / name).read_bytes(), name
