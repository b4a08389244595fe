"""The names code branches on are declared once, beside the schema's allowed values (``launcher/schema.py``:
``Schedule``, ``Recompute``, ``Profiler``), and product code (``launcher/``, ``models/``, ``data/``) uses the names.
A schedule kind is a word of its own: a string literal equal to one anywhere else fails here. ``none``, ``full``,
``torch`` ... are words of other fields too (and Megatron's own recompute_granularity values), so those fail only
where they are compared with ``train.recompute`` (or a ``recompute``/``granularity`` variable) or ``profile.kind``.
Docstrings, comments and texts that merely contain a name (an override such as ``"schedule.kind=zb_h1"``) are not
such literals; f-string expressions are checked like any code."""
from __future__ import annotations

import ast
from pathlib import Path

from launcher.schema import PROFILERS, RECOMPUTE, SCHEDULES, Profiler, Recompute, Schedule

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("launcher", "models", "data")
DECLARED = {name: f"Schedule.{attr}" for attr, name in vars(Schedule).items() if isinstance(name, str)
            and not attr.startswith("_")}
"""Each declared name -> the name code writes instead of the literal."""
COMPARED = {"recompute": {v: f"Recompute.{k}" for k, v in vars(Recompute).items() if k.isupper()},
            "profile": {v: f"Profiler.{k}" for k, v in vars(Profiler).items() if k.isupper()}}
"""Names that are words of other fields too: checked where compared with the field they name."""
DECLARING = {("launcher/schema.py", name) for name in ("Schedule", "Recompute", "Profiler")}
"""(file, class) where the literals are the declaration itself."""


def name_literals(path: Path) -> list[tuple[int, str]]:
    """(line, value) of every string constant in ``path`` that equals a declared name, outside docstrings
    (string statements) and outside the declaring classes."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else path.name
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            skip.add(id(node.value))
        if isinstance(node, ast.ClassDef) and (rel, node.name) in DECLARING:
            skip.update(id(n) for n in ast.walk(node))
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and id(n) not in skip
            and isinstance(n.value, str) and n.value in DECLARED]


def _compared(node) -> str | None:
    """'recompute' or 'profile' when ``node`` reads train.recompute (or a recompute/granularity variable) or a
    profile's kind (``profile.kind``, ``p.kind``, the profiler's ``self.kind``)."""
    if isinstance(node, ast.Attribute) and node.attr == "recompute" or isinstance(node, ast.Name) and node.id in (
            "recompute", "granularity"):
        return "recompute"
    if isinstance(node, ast.Attribute) and node.attr == "kind" and (
            isinstance(node.value, ast.Attribute) and node.value.attr == "profile"
            or isinstance(node.value, ast.Name) and node.value.id in ("p", "self")):
        return "profile"
    return None


def compared_literals(path: Path) -> list[tuple[int, str, str]]:
    """(line, value, name to write) of every literal of a COMPARED name in a comparison with its field."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        field = next((f for f in map(_compared, operands) if f), None)
        if field is None:
            continue
        for o in operands:
            for c in [o] if isinstance(o, ast.Constant) else getattr(o, "elts", []):
                if isinstance(c, ast.Constant) and c.value in COMPARED[field]:
                    found.append((c.lineno, c.value, COMPARED[field][c.value]))
    return found


def test_the_declared_names_are_the_allowed_values():
    for allowed, names in ((SCHEDULES, Schedule), (RECOMPUTE, Recompute), (PROFILERS, Profiler)):
        assert set(allowed) == {v for k, v in vars(names).items() if k.isupper() and isinstance(v, str)}


def test_no_product_module_spells_a_declared_name():
    found = [f"{path.relative_to(ROOT)}:{line}: {value!r} (write {DECLARED[value]})"
             for top in PRODUCT for path in sorted((ROOT / top).rglob("*.py"))
             for line, value in name_literals(path)]
    assert not found, "literals of declared names:\n" + "\n".join(found)


def test_no_product_module_compares_a_field_with_a_literal_name():
    found = [f"{path.relative_to(ROOT)}:{line}: {value!r} (write {name})"
             for top in PRODUCT for path in sorted((ROOT / top).rglob("*.py"))
             for line, value, name in compared_literals(path)]
    assert not found, "literals compared with train.recompute / profile.kind:\n" + "\n".join(found)


def test_the_check_finds_a_literal(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""zb_h1 in a docstring is prose."""\nX = "schedule.kind=zb_h1"\n'
                       'def f(kind):\n    return kind == "zb_h1" or f"{kind == \'1f1b\'}"\n')
    assert name_literals(planted) == [(4, "zb_h1"), (4, "1f1b")]
    planted.write_text('def f(job, p):\n    return job.train.recompute in ("full", "x") or p.kind == "nsys" '
                       'or job.model.position_embedding == "none"\n')
    assert compared_literals(planted) == [(2, "full", "Recompute.FULL"), (2, "nsys", "Profiler.NSYS")]
