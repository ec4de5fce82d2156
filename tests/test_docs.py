"""The docs name tests as proof of their promises: those tests must exist."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
_CITED = re.compile(r"`(test_\w+\.py)?::(\w+)`")


def _test_names() -> dict[str, set[str]]:
    names = {}
    for path in (ROOT / "tests").glob("test_*.py"):
        tree = ast.parse(path.read_text())
        names[path.name] = {
            node.name
            for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
    return names


def test_every_test_cited_in_security_md_exists():
    names = _test_names()
    cited, missing = 0, []
    for number, line in enumerate((ROOT / "docs/security.md").read_text().splitlines(), 1):
        current = None  # "`a.py::x`, `::y`": y is in a.py too
        for match in _CITED.finditer(line):
            current = match.group(1) or current
            cited += 1
            if current is None or match.group(2) not in names.get(current, set()):
                missing.append(f"docs/security.md:{number}: {match.group(0)}")
    assert cited > 50
    assert not missing, missing
