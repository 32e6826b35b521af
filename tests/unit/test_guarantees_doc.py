"""docs/guarantees.md names, for every promise, the tests that check it: each named test must exist (a
renamed or removed test fails here, so the page never cites a check that is gone), and every row names one."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "guarantees.md"
CITED = re.compile(r"`(tests/[\w/]+\.py)::(\w+)`")


def _tests(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.name.startswith("test")}


def test_every_test_the_guarantees_cite_exists():
    text = DOC.read_text()
    cited = CITED.findall(text)
    assert len(cited) >= 20
    missing = [f"{f}::{t}" for f, t in cited if not (ROOT / f).is_file() or t not in _tests(ROOT / f)]
    assert not missing, f"docs/guarantees.md cites tests that do not exist: {missing}"


def test_every_promise_names_a_test():
    rows = [line for line in DOC.read_text().splitlines()
            if line.startswith("| ") and not line.startswith("| promise") and not line.startswith("|---")]
    assert rows
    assert all(CITED.search(r) for r in rows), [r[:80] for r in rows if not CITED.search(r)]
