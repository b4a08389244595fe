"""Relative paths in a job (issue 26): one rule for the login node and the ranks.

A relative path (output_dir, checkpoint.dir, checkpoint.load, checkpoint.load_hf, data.blend prefixes,
data.tokenizer, data.cache_dir) is relative to the directory ``python -m launcher`` runs in, and the bundle's
config.yaml holds it absolute: the ranks (launch.sh does ``cd {{ workdir }}``) never resolve a path against
their own working directory. With a container image a relative path is refused (the container does not see the
launcher's working directory).
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from conftest import ROOT
from launcher.core import load_job


def _rank_view(bundle: Path, value: str) -> str:
    """The file a rank opens for a path of config.yaml: launch.sh's ``cd WORKDIR`` first, so a relative value
    lands under WORKDIR (os.path.join keeps an absolute value as it is)."""
    workdir = re.search(r"^cd (.+)$", (bundle / "launch.sh").read_text(), re.MULTILINE).group(1).strip("'")
    return os.path.normpath(os.path.join(workdir, value))


def test_relative_paths_from_another_directory_reach_the_ranks_as_the_login_node_checked(tmp_path, monkeypatch, cli):
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "d").mkdir(parents=True)
    for name in ("smoke_text_document.bin", "smoke_text_document.idx", "tokenizer.json"):
        shutil.copy(ROOT / "data" / "assets" / name, elsewhere / "d" / name)
    (elsewhere / "prev").mkdir()
    # a checkpoint there (dist_checkpointing's marker): an empty directory is refused by the resume plan, as the ranks
    # would refuse it (launcher/resume_plan.py)
    (elsewhere / "prev" / "metadata.json").write_text("{}")
    monkeypatch.chdir(elsewhere)  # not the repository root, not launch.sh's workdir
    code, out, err = cli("recipe=smoke", "action=render", "output_dir=out", "checkpoint.dir=ck",
                         "checkpoint.load=prev", "data.blend=[d/smoke_text_document]", "data.tokenizer=d/tokenizer.json",
                         "data.cache_dir=cache")
    assert code == 0, err  # the login node's data pre-flight found the dataset under this directory
    bundle = Path(out.split("bundle: ", 1)[1].split()[0])
    assert bundle.parent == elsewhere / "out"
    job = load_job(bundle / "config.yaml")
    wanted = {"checkpoint.dir": (job.checkpoint.dir, "ck"), "checkpoint.load": (job.checkpoint.load, "prev"),
              "data.blend": (job.data.blend[0], "d/smoke_text_document"),
              "data.tokenizer": (job.data.tokenizer, "d/tokenizer.json"), "data.cache_dir": (job.data.cache_dir, "cache"),
              "output_dir": (job.output_dir, "out")}
    for field, (written, given) in wanted.items():
        assert os.path.isabs(written), f"{field}={written} is relative in config.yaml"
        assert _rank_view(bundle, written) == str(elsewhere / given), field


def test_every_path_field_is_made_absolute_once(tmp_path):
    from launcher.config import compose_job
    from launcher.core.paths import with_absolute_paths

    job = compose_job(["recipe=smoke", "output_dir=o", "checkpoint.dir='~/c'", "checkpoint.load=l",
                       "checkpoint.load_hf=h", "data.blend=[0.5,a,0.5,/abs/b]", "data.tokenizer=t.json",
                       "data.cache_dir=./x/../cache"])
    out = with_absolute_paths(job, base=str(tmp_path))
    assert out.output_dir == str(tmp_path / "o")
    assert out.checkpoint.dir == os.path.expanduser("~/c")
    assert (out.checkpoint.load, out.checkpoint.load_hf) == (str(tmp_path / "l"), str(tmp_path / "h"))
    assert list(out.data.blend) == [0.5, str(tmp_path / "a"), 0.5, "/abs/b"]
    assert (out.data.tokenizer, out.data.cache_dir) == (str(tmp_path / "t.json"), str(tmp_path / "cache"))
    assert with_absolute_paths(out, base="/elsewhere") == out  # absolute paths stay as they are


def test_relative_path_with_a_container_image_is_one_line(cli):
    code, out, err = cli("recipe=llama3_8b", "cluster=h100", "cluster.container_image=nvcr.io/nvidia/pytorch:25.01-py3",
                         "cluster.container_mounts=[/lustre:/lustre]", "output_dir=/lustre/runs",
                         "checkpoint.dir=ck", "action=validate")
    assert code == 2
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert lines == [ln for ln in lines if "checkpoint.dir='ck':" in ln] and len(lines) == 1, err
    assert "container" in lines[0] and "try checkpoint.dir=/lustre/ck" in lines[0]
