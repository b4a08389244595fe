"""One reported problem with a job: the field, its value, the rule it breaks, and a valid alternative."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

EXIT_USAGE = 2
"""Exit code for every user error (bad config, invalid layout, failed pre-flight)."""


@dataclass(frozen=True)
class Problem:
    """A validation or pre-flight finding. Errors stop the launcher (exit 2); warnings are printed."""

    field: str
    """Dotted config path, e.g. parallel.tensor."""
    value: Any
    """The offending value."""
    rule: str
    """What must hold, in words."""
    hint: str
    """A valid alternative the user can type."""
    severity: str = "error"
    """error or warning."""

    def line(self) -> str:
        """The one-line message: field, value, rule, alternative."""
        tag = "error" if self.severity == "error" else "warning"
        return f"{tag}: {self.field}={self.value!r}: {self.rule}; try {self.hint}"


def report(problems: list[Problem]) -> None:
    """Print each problem as its one line on stderr."""
    for problem in problems:
        print(problem.line(), file=sys.stderr)


def errors(problems: list[Problem]) -> list[Problem]:
    """Only the problems that stop the launcher."""
    return [p for p in problems if p.severity == "error"]
