"""``launcher.validate.generic.BOUNDS`` is total: every numeric schema field (int or float, or a list of them, any
section) has a declared range or is listed in ``NOT_BOUNDED`` with why; and every declared range refuses a value
just outside it with one line naming the field, the value, the rule and a valid alternative."""
from __future__ import annotations

import dataclasses
import re

import pytest

from launcher import schema
from launcher.config import compose_job
from launcher.fields import FIELD_TYPES, parse_value
from launcher.validate.generic import BOUNDS, NOT_BOUNDED, validate_bounds

NUMERIC = re.compile(r"\b(int|float)\b")


def field_types(job_cls=schema.JobConfig, sections=schema.SECTIONS) -> dict[str, str]:
    """'section.field' -> annotation text, walking the schema's dataclasses."""
    out = {}
    for f in dataclasses.fields(job_cls):
        cls = sections.get(f.name)
        out.update({f"{f.name}.{g.name}": str(g.type) for g in dataclasses.fields(cls)} if cls else {f.name: str(f.type)})
    return out


def unranged(types: dict[str, str]) -> list[str]:
    """Numeric fields in neither BOUNDS nor NOT_BOUNDED."""
    return [n for n, kind in types.items() if NUMERIC.search(kind) and n not in BOUNDS and n not in NOT_BOUNDED]


def test_every_numeric_field_is_bounded_or_says_why_not():
    types = field_types()
    assert not unranged(types)
    numeric = {n for n, kind in types.items() if NUMERIC.search(kind)}
    assert not set(BOUNDS) & set(NOT_BOUNDED)
    assert set(BOUNDS) | set(NOT_BOUNDED) <= numeric, (set(BOUNDS) | set(NOT_BOUNDED)) - numeric  # no stale entry
    assert all(why.strip() for why in NOT_BOUNDED.values())


def test_a_new_unbounded_numeric_field_is_found():
    @dataclasses.dataclass
    class GrownData(schema.DataConfig):
        prefetch_factor: int = 2
        shuffle: bool = True  # not numeric
        label: str = "x"

    @dataclasses.dataclass
    class GrownJob(schema.JobConfig):
        data: GrownData = dataclasses.field(default_factory=GrownData)

    assert unranged(field_types(GrownJob, {**schema.SECTIONS, "data": GrownData})) == ["data.prefetch_factor"]


def _outside(name: str) -> list:
    """Values just outside the field's range: at an open end, one below a closed low end, one above a closed high."""
    bound, integer = BOUNDS[name], "int" in FIELD_TYPES[name][1]
    step = 1 if integer else 0.5
    values = []
    if bound.lo is not None:
        values.append(bound.lo if bound.lo_open else bound.lo - step)
    if bound.hi is not None:
        values.append(bound.hi if bound.hi_open else bound.hi + step)
    return [int(v) if integer else float(v) for v in values]


@pytest.mark.parametrize("name", sorted(BOUNDS))
def test_a_value_outside_the_range_is_one_line_with_a_valid_alternative(name):
    job = compose_job(["recipe=smoke"])
    section, _, attr = name.rpartition(".")
    for value in _outside(name):
        setattr(getattr(job, section) if section else job, attr, value)
        [problem] = [p for p in validate_bounds(job) if p.field == name]
        line = problem.line()
        assert line.startswith(f"error: {name}={value!r}: must be ") and "\n" not in line, line
        assert BOUNDS[name].describe("int" in FIELD_TYPES[name][1]) in line, line  # the rule, in words
        key, _, text = problem.hint.partition("=")
        assert key == name and BOUNDS[name].holds(parse_value(name, text)), line  # the alternative is in range
