"""Docs that stay true: the commands of README.md and docs/*.md run, their shown output still appears, every relative
link and anchor resolves, and docs/fields.md is what the schema generates.

Conventions the docs follow (README.md says them to readers):
- a ```console block is a session: `$ python -m launcher ...` lines are run in-process (the `cli` fixture), in order,
  in one scratch directory per page that holds a copy of a real finished run bundle (tests/fixtures/docs/bundles:
  `make run`'s bundle of 2026-12-05, its checkpoint's tensor files as sparse files of their recorded sizes); the
  lines shown after a command must appear in its output, in order (whitespace is not compared, so a table rich
  wraps differently still matches; `...` stands for any text within a line, a line of `...` for lines left out);
  a shown `error:` line means exit code 2, else 0;
- a ```bash block's launcher commands run too (exit 0), with action=validate in place of the actions that start
  or submit a run (run, submit, or none);
- other blocks (```text, plain) are recorded output of runs these tests cannot repeat; their launcher commands, like
  every command that names files of a cluster (/lustre, <bundle>, ...) or a sub-command that needs torch or a run
  (import, export-hf, import-hf, post, cancel), are checked only for their field names (launcher/overrides.py).
"""
from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from conftest import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FIXTURE = ROOT / "tests" / "fixtures" / "docs" / "bundles"
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```", re.M | re.S)
RUNS = ("runs", "status", "logs", "checkpoint-info")          # login-node sub-commands, run on the fixture bundle
NOT_RUN = ("cancel", "import", "export-hf", "import-hf", "post")  # need a live run, torch, or the user's files
STARTS = ("run", "submit", "default", "bench")                # actions that would start or submit a run
CLUSTER_FILES = ("/lustre", "<", "/opt/", "registry.example.com")


class Command:
    def __init__(self, page: Path, lang: str, text: str, shown: list[str]):
        self.page, self.lang, self.text, self.shown = page, lang, text, shown
        self.argv = shlex.split(text, comments=True)[3:]  # after `python -m launcher`

    def __repr__(self):
        return f"{self.page.relative_to(ROOT)}: python -m launcher {' '.join(self.argv)}"


def _logical_lines(body: str) -> list[str]:
    out, cur = [], ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1] + " "
            continue
        out.append(cur + line)
        cur = ""
    return out + ([cur] if cur else [])


def commands(page: Path) -> list[Command]:
    found = []
    for lang, body in FENCE.findall(page.read_text()):
        lines = _logical_lines(body)
        for i, line in enumerate(lines):
            text = line[2:] if line.startswith("$ ") else line
            if not text.startswith("python -m launcher"):
                continue
            shown = []
            if lang == "console":
                for nxt in lines[i + 1:]:
                    if nxt.startswith("$ "):
                        break
                    shown.append(nxt)
            found.append(Command(page, lang, text, shown))
    return found


def _runnable(cmd: Command) -> bool:
    if cmd.lang not in ("console", "bash") or "..." in cmd.argv:
        return False
    if any(marker in tok for tok in cmd.argv for marker in CLUSTER_FILES):
        return False
    return not (cmd.argv and cmd.argv[0] in NOT_RUN)


def _argv_to_run(cmd: Command) -> list[str]:
    argv = list(cmd.argv)
    if argv and argv[0] in RUNS or any(a in ("--help", "-h", "--cfg") for a in argv):
        return argv
    action = next((a.split("=", 1)[1] for a in argv if a.startswith("action=")), "default")
    if action in STARTS:
        argv = [a for a in argv if not a.startswith("action=")] + ["action=validate"]
    return argv


def _pattern(line: str) -> re.Pattern:
    parts = [r"\s+".join(map(re.escape, part.split())) for part in line.strip().split("...")]
    return re.compile(".*?".join(parts))


def shown_lines_appear(shown: list[str], output: str) -> str | None:
    """None when every shown line appears in `output` in order; else the first line that does not."""
    text, at = " ".join(output.split()), 0
    for line in shown:
        if not line.strip() or line.strip() == "...":
            continue
        found = _pattern(line).search(text, at)
        if not found:
            return line
        at = found.end()
    return None


def _scratch(tmp_path: Path) -> Path:
    """A copy of the fixture bundle under tmp_path/runs, its paths pointed there, its tensor files sparse."""
    import json

    for bundle in FIXTURE.iterdir():
        dst = tmp_path / "runs" / bundle.name
        shutil.copytree(bundle, dst)
        for f in dst.rglob("*"):
            if f.is_file():
                f.write_text(f.read_text().replace("@DOCS_TMP@", str(tmp_path)))
        for manifest in dst.glob("checkpoints/iter_*/launcher.json"):
            for name, meta in json.loads(manifest.read_text())["files"].items():
                if not (manifest.parent / name).exists():
                    with open(manifest.parent / name, "wb") as fh:
                        fh.truncate(meta["size"])
    return tmp_path


def _check_fields(cmd: Command) -> list:
    from launcher.overrides import check_override

    problems = [check_override(a) for a in cmd.argv
                if "=" in a and not a.startswith("-") and "/" not in a.split("=")[0]]
    return [p for p in problems if p]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_documented_commands_run_and_show_their_real_output(page, cli, tmp_path, monkeypatch):
    cmds = commands(page)
    monkeypatch.chdir(_scratch(tmp_path))
    monkeypatch.setenv("COLUMNS", "160")
    for cmd in cmds:
        refused = any(s.startswith("error:") for s in cmd.shown)  # a session may show a refused name on purpose
        assert refused or not _check_fields(cmd), f"{cmd}: {_check_fields(cmd)}"
        if not _runnable(cmd):
            continue
        code, out, err = cli(*_argv_to_run(cmd))
        want = 2 if refused else 0
        assert code == want, f"{cmd}: exit {code}, expected {want}\n{out}{err}"
        missing = shown_lines_appear(cmd.shown, out + "\n" + err)
        assert missing is None, f"{cmd}: the shown line\n  {missing}\nis not in the output:\n{out}{err}"


def test_the_readme_runs_its_everyday_commands():
    """The README's sessions stay sessions: validate, plan, search, render, runs, status, logs, checkpoint-info."""
    ran = {(c.argv[0] if c.argv[0] in RUNS else next(a for a in _argv_to_run(c) if a.startswith("action=")))
           for c in commands(ROOT / "README.md") if _runnable(c) and c.shown}
    assert ran >= {"action=validate", "action=plan", "action=search", "action=render", *RUNS}, ran


def test_the_matcher_allows_placeholders_and_refuses_a_changed_line():
    out = "bundle: /tmp/x/runs/smoke-20261205-130826\nstep:  30/30, loss 6.7988\nthe end\n"
    assert shown_lines_appear(["bundle: .../runs/smoke-...", "...", "step: 30/30, loss 6.7988"], out) is None
    assert shown_lines_appear(["step: 30/30, loss 6.7989"], out) == "step: 30/30, loss 6.7989"
    assert shown_lines_appear(["the end", "bundle: ..."], out) == "bundle: ..."  # order counts


# ---- links and anchors -------------------------------------------------------------------------------------------

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (except - and _), spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    body = FENCE.sub("", page.read_text())
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", body, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    bad = []
    for target in LINK.findall(FENCE.sub("", page.read_text())):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            bad.append(f"{target}: no heading with anchor #{anchor}")
    assert not bad, f"{page.relative_to(ROOT)}: {bad}"


def test_every_docs_page_is_reachable_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in LINK.findall((ROOT / "README.md").read_text())}
    assert set(PAGES[1:]) <= linked, sorted(p.name for p in set(PAGES[1:]) - linked)


# ---- the generated fields page -----------------------------------------------------------------------------------

def test_the_fields_page_is_generated_from_the_schema_and_current():
    from launcher.help import fields_markdown

    assert (ROOT / "docs" / "fields.md").read_text() == fields_markdown(), \
        "docs/fields.md is stale: python -m launcher.help --fields-md > docs/fields.md"


def test_the_tests_map_is_current():
    """tests/README.md (the product's rooms and the test modules of each) is what tests/_test_map.py reads from the
    tests as they are: a moved product file or a new test module regenerates it."""
    import subprocess
    import sys

    printed = subprocess.run([sys.executable, str(ROOT / "tests" / "_test_map.py")], capture_output=True, text=True,
                             check=True).stdout
    assert (ROOT / "tests" / "README.md").read_text() == printed, \
        "tests/README.md is stale: python tests/_test_map.py > tests/README.md"
