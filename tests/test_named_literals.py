"""The names code branches on are declared once, beside the schema's allowed values (``launcher/schema.py``:
``Schedule``), and product code (``launcher/``, ``models/``, ``data/``) uses the names: a string literal equal to
one of them anywhere else fails here. Docstrings, comments and texts that merely contain a name (an override such
as ``"schedule.kind=zb_h1"``) are not such literals; f-string expressions are checked like any code."""
from __future__ import annotations

import ast
from pathlib import Path

from launcher.schema import SCHEDULES, Schedule

ROOT = Path(__file__).resolve().parents[1]
PRODUCT = ("launcher", "models", "data")
DECLARED = {name: f"Schedule.{attr}" for attr, name in vars(Schedule).items() if isinstance(name, str)
            and not attr.startswith("_")}
"""Each declared name -> the name code writes instead of the literal."""
DECLARING = {("launcher/schema.py", "Schedule")}
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


def test_the_declared_names_are_the_allowed_values():
    assert set(SCHEDULES) == {v for k, v in vars(Schedule).items() if k.isupper() and isinstance(v, str)}


def test_no_product_module_spells_a_declared_name():
    found = [f"{path.relative_to(ROOT)}:{line}: {value!r} (write {DECLARED[value]})"
             for top in PRODUCT for path in sorted((ROOT / top).rglob("*.py"))
             for line, value in name_literals(path)]
    assert not found, "literals of declared names:\n" + "\n".join(found)


def test_the_check_finds_a_literal(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text('"""zb_h1 in a docstring is prose."""\nX = "schedule.kind=zb_h1"\n'
                       'def f(kind):\n    return kind == "zb_h1" or f"{kind == \'1f1b\'}"\n')
    assert name_literals(planted) == [(4, "zb_h1"), (4, "1f1b")]
