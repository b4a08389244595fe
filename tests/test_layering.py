"""The two wings, checked statically: every import of every module, at any depth (function bodies too),
parsed with ``ast`` and followed through the project's own modules, without running any of them.

- Every Python module of the repository is placed in one wing: the shared core, login, rank, a tool of its own,
  or the tests (``tests/``, ``benchmarks/`` measure the product); a Python file in a folder not scanned here
  fails too, so a new folder cannot go unchecked.
- Login-node modules (compose, validate, plan, render, submit) reach no torch, megatron, transformer_engine,
  apex, and none of the rank wing (``launcher.rank``, ``models``).
- The rank wing reaches no login-node module: of the launcher it imports only the schema and the core.
- The shared core reaches only itself, the standard library and the third-party packages of ``SHARED_DEPENDS``,
  each imported only by the core modules its reason names.
- No wing reaches a tool, and no product module reaches the tests or benchmarks.
- No module imports itself back through others (an import circle), counting imports inside functions.
- The rank's training objects (model, DDP, optimizer, scheduler, config hooks) are built in one place,
  ``launcher.rank.training.build``: no other file calls a step of that sequence, except the partial builds of
  ``PARTIAL_BUILDS``, each with why.
- The rank entry's training function and ``Loop.run`` stay short (``SHORT_FUNCTIONS``: lines and parameters).
"""
from __future__ import annotations

import ast
import os
import sys
from functools import lru_cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("launcher", "models", "data", "tests", "benchmarks")
"""The folders holding Python modules; test_every_python_file_is_scanned fails on a .py file elsewhere."""
GPU_AND_TORCH = ("torch", "megatron", "transformer_engine", "apex", "triton")
SHARED = ("launcher", "launcher.schema", "launcher.core")
"""Read by both wings: the package (ROOT), the schema and the torch-free core."""
SHARED_DEPENDS = {
    "omegaconf": (("launcher.schema", "launcher.core.jobfile"),
                  "the schema's structured config and the bundle's config.yaml"),
    "hydra": (("launcher.schema",), "the schema registers in Hydra's ConfigStore at import"),
    "matplotlib": (("launcher.core.pipeline.timeline",), "drawing a timeline (draw only, imported inside it)"),
    "numpy": (("launcher.core.indexed_files",), "the .idx header and a .bin's token ids, memory-mapped"),
}
"""The shared core's third-party dependencies: package -> (the core modules that may import it, why); everything
else the core reaches is the standard library or the core itself."""
RANK = ("launcher.rank", "models")
LOGIN = ("launcher.__main__", "launcher.cli", "launcher.actions", "launcher.validate", "launcher.plan",
         "launcher.render", "launcher.executor", "launcher.overrides", "launcher.help", "launcher.config",
         "launcher.problems", "launcher.fields", "launcher.data_preflight", "launcher.megatron_lm", "launcher.catalog",
         "launcher.runs", "launcher.run_state", "launcher.resume_plan", "launcher.calibration", "launcher.slurm_tool",
         "launcher.preflight")
TOOLS = ("launcher.hf", "data", "launcher.checkpoint_state")
"""Commands of their own: export-hf/import-hf need torch on a login node (they read and write torch_dist
checkpoints; ``launcher.__main__`` starts them by module name), and the preprocessor package ``data``
(``python -m data.preprocess``, its engine ``data.corpus``, encoders, Slurm array, and the script that built the
shipped assets in ``data/assets``). A tool may use a wing (the preprocessor loads the ranks' tokenizer and runs
the login node's dataset check on its shards); no wing reaches a tool (checked below)."""
TESTS = ("tests", "benchmarks")
"""What measures the product: the test suite and its helpers, and the benchmarks behind the README's figures."""
OUTPUTS = ("__pycache__", "build", "runs", "outputs")
"""Folders of build and run output (.gitignore's), never source."""


def _skipped(path: Path) -> bool:
    """Not the repository's own source: the venv, git, build and run output, caches."""
    return any(part.startswith(".") or part.endswith(".egg-info") or part in OUTPUTS
               for part in path.relative_to(ROOT).parts)


def _python_files():
    """Every .py file of the repository, without descending into what ``_skipped`` leaves out (the venv alone
    holds tens of thousands of files)."""
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not _skipped(Path(folder, d))]
        yield from (Path(folder, f) for f in files if f.endswith(".py"))


def _modules() -> dict[str, Path]:
    found = {}
    for top in SCANNED:
        for path in (ROOT / top).rglob("*.py"):
            if _skipped(path):
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


@lru_cache(maxsize=None)
def direct_imports(module: str) -> frozenset[str]:
    """Every module named by an import statement anywhere in ``module`` (absolute names)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # `from pkg import submodule`
    top = module.split(".")[0]
    if top in TESTS:  # tests and benchmarks put their own folder on sys.path: `from _hf_tiny import ...`
        names.update(f"{top}.{n}" for n in list(names) if f"{top}.{n.split('.')[0]}" in MODULES)
    return frozenset(n for n in names if n)


def _project(name: str) -> list[str]:
    """The project module(s) an imported name loads: the module and every package above it."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in MODULES]


@lru_cache(maxsize=None)
def reach(module: str) -> frozenset[str]:
    """All names imported by ``module`` and, transitively, by the project modules it imports."""
    seen, todo, names = {module}, [module], set()
    while todo:
        for name in direct_imports(todo.pop()):
            names.add(name)
            for dep in _project(name):
                if dep not in seen:
                    seen.add(dep)
                    todo.append(dep)
    return frozenset(names | seen)


def _wing(module: str) -> str:
    if _in(module, RANK):
        return "rank"
    if module in SHARED or _in(module, ("launcher.core",)):
        return "shared"
    if _in(module, LOGIN):
        return "login"
    if _in(module, TOOLS):
        return "tool"
    if _in(module, TESTS):
        return "tests"
    return "unplaced"


def test_every_module_has_a_wing():
    unplaced = [m for m in MODULES if _wing(m) == "unplaced"]
    assert not unplaced, f"place these in a wing in tests/test_layering.py: {unplaced}"


def test_an_unplaced_module_is_found(tmp_path, monkeypatch):
    """A new module of a folder no wing names (``launcher/newthing.py``) is reported, not silently passed."""
    monkeypatch.setitem(MODULES, "launcher.newthing", tmp_path / "newthing.py")
    assert _wing("launcher.newthing") == "unplaced"
    with pytest.raises(AssertionError, match="launcher.newthing"):
        test_every_module_has_a_wing()


def test_every_python_file_is_scanned():
    """A Python file outside the scanned folders (a new top-level package, a script in slurm/) has no wing."""
    outside = sorted(str(p.relative_to(ROOT)) for p in _python_files() if p.relative_to(ROOT).parts[0] not in SCANNED)
    assert not outside, f"add their folder to SCANNED and place its modules in a wing: {outside}"


def _imports_of(module: str) -> set[str]:
    """The project modules ``module`` imports (the deepest one each import names; its own packages left out,
    since a submodule loading its package is no circle)."""
    own = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
    return {found[-1] for name in direct_imports(module) for found in [_project(name)]
            if found and found[-1] != module and found[-1] not in own}


def import_circles(modules) -> list[list[str]]:
    """The strongly connected groups of more than one module in the import graph (Tarjan)."""
    graph = {m: _imports_of(m) for m in modules}
    index, low, stack, on, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return circles


def test_no_import_circles():
    assert import_circles(MODULES) == []


def test_the_circle_check_finds_a_circle(tmp_path, monkeypatch):
    """Two modules importing each other inside functions (how models.builder and models.mtp did): found."""
    (tmp_path / "a.py").write_text("def f():\n    from models.fake_b import g\n")
    (tmp_path / "b.py").write_text("def g():\n    from models.fake_a import f\n")
    monkeypatch.setitem(MODULES, "models.fake_a", tmp_path / "a.py")
    monkeypatch.setitem(MODULES, "models.fake_b", tmp_path / "b.py")
    direct_imports.cache_clear()
    try:
        assert ["models.fake_a", "models.fake_b"] in import_circles(MODULES)
    finally:
        direct_imports.cache_clear()
        reach.cache_clear()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _wing(m) == "login"))
def test_login_node_module_reaches_no_torch_and_no_rank_wing(module):
    bad = sorted(n for n in reach(module) if _in(n, GPU_AND_TORCH) or _in(n, RANK))
    assert not bad, f"{module} reaches {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _wing(m) == "rank"))
def test_rank_wing_module_reaches_no_login_module(module):
    bad = sorted(n for n in reach(module) if _in(n, LOGIN))
    assert not bad, f"{module} reaches {bad}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _wing(m) == "shared"))
def test_shared_core_reaches_only_itself_and_no_torch(module):
    bad = sorted(n for n in reach(module) if _in(n, GPU_AND_TORCH) or _in(n, RANK) or _in(n, LOGIN))
    assert not bad, f"{module} reaches {bad}"


def _third_party(names) -> set[str]:
    return {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"launcher", "__future__"}


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _wing(m) == "shared"))
def test_shared_core_reaches_only_its_declared_dependencies(module):
    bad = sorted(t for t in _third_party(reach(module)) if t not in SHARED_DEPENDS)
    assert not bad, f"{module} reaches {bad}: add it to SHARED_DEPENDS with why, or keep the core free of it"
    strays = sorted(t for t in _third_party(direct_imports(module)) if module not in SHARED_DEPENDS[t][0])
    assert not strays, (f"{module} imports {strays}, which SHARED_DEPENDS allows only in "
                        f"{[SHARED_DEPENDS[t][0] for t in strays]}: name it there with why, or keep it out")


def test_a_core_module_off_its_list_is_found(tmp_path, monkeypatch):
    """A core module importing numpy (allowed in indexed_files only) or requests (not allowed at all) fails."""
    for name, code, match in (("launcher.core.fake_np", "def f():\n    import numpy\n", "allows only in"),
                              ("launcher.core.fake_rq", "import requests\n", "add it to SHARED_DEPENDS")):
        fake = tmp_path / f"{name}.py"
        fake.write_text(code)
        monkeypatch.setitem(MODULES, name, fake)
        direct_imports.cache_clear()
        reach.cache_clear()
        try:
            with pytest.raises(AssertionError, match=match):
                test_shared_core_reaches_only_its_declared_dependencies(name)
        finally:
            direct_imports.cache_clear()
            reach.cache_clear()


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _wing(m) in ("login", "rank", "shared")))
def test_no_wing_reaches_a_tool(module):
    """The HF tools import torch: a login module reaching them would too; the rank wing has no business there;
    the preprocessor is a command of its own (the ranks read what it wrote, not its code)."""
    bad = sorted(n for n in reach(module) if _in(n, TOOLS))
    assert not bad, f"{module} reaches {bad}"


_WITHOUT_HYDRA = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("hydra", "omegaconf"):
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
import launcher.core, launcher.rank.training, launcher.rank.loop
from launcher.core import derive
from launcher.schema import JobConfig
print(derive(JobConfig()).world)
"""


def test_the_core_and_the_rank_wing_import_without_hydra_or_omegaconf():
    """The shared core and the rank wing import, and derive a layout, with Hydra and OmegaConf unimportable: the
    ranks read config.yaml (OmegaConf, when called) and never compose, and the bare GPU image the benchmark runs on
    has neither (launcher/core/jobfile.py). Until 9f3c6a2 launcher.schema imported Hydra's ConfigStore at its top,
    and this failed with "ImportError: blocked: hydra"."""
    import subprocess

    proc = subprocess.run([sys.executable, "-c", _WITHOUT_HYDRA], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0 and proc.stdout.strip().isdigit(), proc.stderr[-2000:]


@pytest.mark.parametrize("module", sorted(m for m in MODULES if _wing(m) != "tests"))
def test_no_product_module_reaches_the_tests(module):
    bad = sorted(n for n in reach(module) if _in(n, TESTS))
    assert not bad, f"{module} reaches {bad}: test support lives under tests/, and the product does not use it"


def test_the_hf_tools_are_handed_over_by_name_before_the_login_cli():
    """``python -m launcher export-hf`` must not import the login CLI (nor the tools statically)."""
    source = (ROOT / "launcher" / "__main__.py").read_text()
    assert "launcher.hf" not in direct_imports("launcher.__main__")
    assert source.index('import_module("launcher.hf")') < source.index("from launcher.cli import main")


def test_the_checker_sees_imports_inside_functions(tmp_path, monkeypatch):
    """The walk must find a lazy import buried in a function body (a mutation the static test must catch)."""
    fake = tmp_path / "fake.py"
    fake.write_text("def f():\n    if True:\n        from launcher.plan import plan_job\n")
    monkeypatch.setitem(MODULES, "models.fake", fake)
    direct_imports.cache_clear()
    reach.cache_clear()
    try:
        assert "launcher.plan" in reach("models.fake")
        assert _in("launcher.plan", LOGIN)
    finally:
        direct_imports.cache_clear()
        reach.cache_clear()


def test_rank_entry_lives_in_the_rank_wing_and_launch_starts_it():
    assert not (ROOT / "launcher" / "train.py").exists()
    assert "-m launcher.rank --bundle" in (ROOT / "slurm" / "launch.sh.j2").read_text()


ROOM_LINES = 620
"""A product module over ~600 lines says in its docstring's first three lines why it is one room (issue 26)."""


def long_modules_without_a_reason(modules: dict) -> list[str]:
    out = []
    for name, path in sorted(modules.items()):
        if _wing(name) in ("tests",):
            continue
        text = path.read_text()
        doc = ast.get_docstring(ast.parse(text)) or ""
        if text.count("\n") > ROOM_LINES and "one room" not in " ".join(doc.splitlines()[:3]).lower():
            out.append(f"{name}: {text.count(chr(10))} lines")
    return out


def test_no_product_module_is_long_without_saying_why():
    assert long_modules_without_a_reason(_modules()) == []


def test_a_long_module_without_a_reason_is_found(tmp_path):
    long = tmp_path / "long.py"
    long.write_text('"""A module."""\n' + "x = 1\n" * (ROOM_LINES + 1))
    said = tmp_path / "said.py"
    said.write_text('"""A module.\nOne room: why.\n"""\n' + "x = 1\n" * (ROOM_LINES + 1))
    assert long_modules_without_a_reason({"launcher.long": long, "launcher.said": said}) == ["launcher.long: 622 lines"]


BUILD_SEQUENCE = ("build_model", "wrap_ddp", "build_optimizer", "build_scheduler", "hook_model_config")
"""The steps of a rank's build, in production's order (``launcher.rank.training.build``); a copy
of them elsewhere drifts from what a job runs (recompute, determinism and the backend checks were left out of
copies before: issue 43)."""
BUILDERS = ("launcher/rank/training.py", "launcher/rank/optim.py")
"""The one builder, and the module that defines the optimizer's steps."""
PARTIAL_BUILDS = {
    "models/__init__.py": ({"build_model"}, "the package's lazy forward to models.builder.build_model (no build)"),
    "launcher/hf/importer.py": (
        {"build_model"}, "one process's GPTModel to load HF weights into and compare logits: no DDP, no optimizer"),
    "tests/_seed_worker.py": (
        {"build_model"}, "fingerprints a stage's initial weights on the CPU and the GPU init path: the model alone"),
    "tests/test_catalogue.py": (
        {"build_model"}, "the model builder's unit test per architecture (GPTModel forward/backward, no training)"),
    "tests/test_combined_1f1b.py": (
        {"build_model"}, "one MoE chunk for forward_step's schedule plan, in this process: no DDP, no optimizer"),
    "tests/test_models_build.py": ({"build_model"}, "the unit tests of models.build_model itself"),
    "tests/test_plan_activations_real.py": (
        {"build_model"}, "counts the tensors a GPTModel forward saves: DDP and optimizer hold no activations"),
    "tests/test_weight_fields.py": (
        {"build_model"}, "compares the state dicts of tiny models that differ in one model field: the model alone"),
    "tests/test_wiring.py": (
        {"build_model"}, "records the GPTModel arguments models.build_model passes (GPTModel replaced)"),
    "tests/test_rank_param_sync.py": (
        {"hook_model_config"}, "the unit tests of optim.hook_model_config itself, on stand-in chunks"),
    "tests/test_train_options.py": (
        {"build_scheduler"}, "the unit tests of the LR scheduler factory, on a stand-in optimizer"),
}
"""file -> (the steps of BUILD_SEQUENCE it may call, why it builds only that part)."""


def build_sequence_calls(path: Path) -> set[str]:
    """The steps of BUILD_SEQUENCE that ``path`` calls: ``f(...)`` or ``mod.f(...)``, also under an import alias
    (``from models import build_model as bm``); a mention in a docstring or comment is no call."""
    tree = ast.parse(path.read_text(), str(path))
    alias = {a.asname: a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
             for a in node.names if a.name in BUILD_SEQUENCE and a.asname}
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
            called.add(alias.get(name, name))
    return called & set(BUILD_SEQUENCE)


def build_sequence_copies(files: dict[str, Path]) -> list[str]:
    """``files`` (path from the repository root -> file) that call a step of the build sequence outside the
    builder and beyond what PARTIAL_BUILDS allows them."""
    out = []
    for rel, path in sorted(files.items()):
        if rel in BUILDERS:
            continue
        extra = sorted(build_sequence_calls(path) - PARTIAL_BUILDS.get(rel, (set(), ""))[0])
        if extra:
            out.append(f"{rel} calls {', '.join(extra)}")
    return out


def _source_files() -> dict[str, Path]:
    return {path.relative_to(ROOT).as_posix(): path for path in MODULES.values()}


def test_the_rank_build_sequence_has_one_builder():
    copies = build_sequence_copies(_source_files())
    assert not copies, ("build through launcher.rank.training.build(job, layout) (a job composed with "
                        "launcher.config.compose_job, its layout from launcher.core.derive; loop=False without the "
                        "step loop), or, for a unit "
                        f"test of one step, add the file to PARTIAL_BUILDS with why: {copies}")


def test_every_partial_build_is_still_one():
    """An entry of PARTIAL_BUILDS names a file that calls exactly the steps it allows, and says why."""
    files = _source_files()
    stale = [rel for rel, (steps, why) in PARTIAL_BUILDS.items()
             if not why or rel not in files or build_sequence_calls(files[rel]) != steps]
    assert not stale, f"update PARTIAL_BUILDS: {stale}"


def test_a_copy_of_the_build_sequence_is_found(tmp_path):
    """A worker with its own build (as tests/_combined_1f1b_worker.py had), a step under an alias, an allowed
    model-only test that starts wrapping in DDP and the rank entry building for itself are reported; a docstring
    mention and a call of the builder are not."""
    copy = tmp_path / "copy.py"
    copy.write_text("def one_step(job, layout):\n    from launcher.rank import optim\n"
                    "    from models import build_model\n"
                    "    chunks = build_model(model=job.model, parallel=job.parallel, precision=job.precision)\n"
                    "    model = optim.wrap_ddp(chunks, parallel=job.parallel, precision=job.precision)\n"
                    "    optim.hook_model_config(model, optim.build_optimizer(model, train=job.train), "
                    "parallel=job.parallel)\n")
    aliased = tmp_path / "aliased.py"
    aliased.write_text("from launcher.rank.optim import build_scheduler as sched\nsched(None, train=None, steps=1)\n")
    grown = tmp_path / "grown.py"
    grown.write_text("from launcher.rank import optim\nfrom models import build_model\n"
                     "optim.wrap_ddp(build_model(model=None, parallel=None, precision=None))\n")
    fine = tmp_path / "fine.py"
    fine.write_text('"""Built by build_model( then wrap_ddp(, as entry does."""\n'
                    "from launcher.rank import training\n"
                    "training.build(None, None, loop=False)\n")
    assert build_sequence_copies({"tests/_copy_worker.py": copy, "benchmarks/aliased.py": aliased,
                                  "tests/test_models_build.py": grown, "tests/_fine_worker.py": fine,
                                  "launcher/rank/training.py": copy, "launcher/rank/entry.py": copy}) == [
        "benchmarks/aliased.py calls build_scheduler",
        "launcher/rank/entry.py calls build_model, build_optimizer, hook_model_config, wrap_ddp",
        "tests/_copy_worker.py calls build_model, build_optimizer, hook_model_config, wrap_ddp",
        "tests/test_models_build.py calls wrap_ddp"]


SHORT_FUNCTIONS = {("launcher/rank/entry.py", "_train_locked"): "the rank's pretrain: build, resume, data, train",
                   ("launcher/rank/loop.py", "Loop.run"): "the step loop"}
"""(file, function or Class.method) -> what it is: each at most MAX_FUNCTION_LINES lines (its def to its last
line, docstring included) and MAX_FUNCTION_PARAMETERS parameters (self and cls not counted; issue 43: the
entry's training function had grown to 107 lines and 12 parameters, Loop.run to 16 parameters)."""
MAX_FUNCTION_LINES, MAX_FUNCTION_PARAMETERS = 50, 5


def function_size(path: Path, qualname: str) -> tuple[int, int]:
    """(lines, parameters other than self/cls) of ``qualname`` (``f`` or ``Class.f``) in ``path``, by ``ast``."""
    body = ast.parse(path.read_text(), str(path)).body
    node = None
    for part in qualname.split("."):
        node = next((n for n in body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                     and n.name == part), None)
        if node is None:
            raise LookupError(f"{path}: no {qualname}")
        body = node.body
    a = node.args
    params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, (a.vararg, a.kwarg))]
    if params and params[0].arg in ("self", "cls") and "." in qualname:
        params = params[1:]
    return node.end_lineno - node.lineno + 1, len(params)


def too_long_functions(functions: dict) -> list[str]:
    """``functions`` ((file from the repository root, qualname) -> what) over MAX_FUNCTION_LINES or
    MAX_FUNCTION_PARAMETERS."""
    out = []
    for rel, qualname in sorted(functions):
        lines, params = function_size(ROOT / rel if not Path(rel).is_absolute() else Path(rel), qualname)
        if lines > MAX_FUNCTION_LINES or params > MAX_FUNCTION_PARAMETERS:
            out.append(f"{rel} {qualname}: {lines} lines, {params} parameters")
    return out


def test_the_rank_training_function_and_the_step_loop_are_short():
    assert too_long_functions(SHORT_FUNCTIONS) == [], (
        f"at most {MAX_FUNCTION_LINES} lines and {MAX_FUNCTION_PARAMETERS} parameters: move steps into helpers "
        "(launcher/rank/training.py's Checkpointer, loop.Hooks) instead")


def test_a_long_function_or_one_with_many_parameters_is_found(tmp_path):
    src = tmp_path / "mod.py"
    src.write_text("def short(a, b, c, d, e):\n    return a\n\n\n"
                   "def wide(a, b, c, d, e, f):\n    return a\n\n\n"
                   "def long(a):\n" + "    a += 1\n" * MAX_FUNCTION_LINES + "\n\n"
                   "class Loop:\n    def run(self, a, b, *, c, d, e=None, **kw):\n        return a\n")
    assert function_size(src, "Loop.run") == (2, 6)
    assert too_long_functions({(str(src), "short"): "", (str(src), "wide"): "", (str(src), "long"): "",
                               (str(src), "Loop.run"): ""}) == [
        f"{src} Loop.run: 2 lines, 6 parameters", f"{src} long: {MAX_FUNCTION_LINES + 1} lines, 1 parameters",
        f"{src} wide: 2 lines, 6 parameters"]
