"""Figures the docs quote from a test's own data are read from that test, so they cannot go stale (the README's
measurement tables moved to docs/measurements.md)."""
from __future__ import annotations

import re

from conftest import ROOT


def test_readme_quotes_the_number_of_invalid_configurations_in_the_catalogue():
    from test_invalid_configs import CASES

    page = (ROOT / "docs" / "measurements.md").read_text()
    found = re.findall(r"^\| (\d+) invalid configurations: exit 2", page, re.M)
    assert found == [str(len({c[0] for c in CASES}))] and len(CASES) == len({c[0] for c in CASES}), \
        f"docs/measurements.md says {found}, tests/test_invalid_configs.py has {len(CASES)} cases: update its table"
