"""Figures the README quotes from a test's own data are read from that test, so they cannot go stale."""
from __future__ import annotations

import re

from conftest import ROOT


def test_readme_quotes_the_number_of_invalid_configurations_in_the_catalogue():
    from test_invalid_configs import CASES

    found = re.findall(r"^\| (\d+) invalid configurations: exit 2", (ROOT / "README.md").read_text(), re.M)
    assert found == [str(len({c[0] for c in CASES}))] and len(CASES) == len({c[0] for c in CASES}), \
        f"README says {found}, tests/test_invalid_configs.py has {len(CASES)} cases: update the README's table"
