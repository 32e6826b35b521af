"""benchmarks/results/README.md indexes every file and folder of benchmarks/results/, and names none that
is not there (issue 13 item 5): a result added without a row, or a row left behind by a removed or moved
file, fails here.

The index is the README's table rows whose first cell is one backquoted name (``| `name` | ...``; a
folder written with a trailing ``/``). Every other backquoted file name in the README (``x.json``, a
brace form ``a_{b,c}.json``, a glob ``a_*.json``, or ``folder/file``) must match something under
benchmarks/results/ too.

This test reads benchmarks/results/ on purpose: the folder and its index are what it checks. Other
tests read their copies under tests/fixtures/ (issue 31 item 7)."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
README = RESULTS / "README.md"

ROW = re.compile(r"^\|\s*`([^`]+)`\s*\|")
TICKED = re.compile(r"`([^`\s]+)`")
RESULT_EXT = (".json", ".jsonl", ".txt", ".log", ".md", ".csv", ".png", ".html")


def _index() -> list[str]:
    return [m.group(1).rstrip("/") for line in README.read_text().splitlines() if (m := ROW.match(line))]


def _expand(name: str) -> list[str]:
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [e for alt in m.group(1).split(",") for e in _expand(name[: m.start()] + alt + name[m.end():])]


def test_every_result_has_a_row() -> None:
    indexed = set(_index())
    present = {p.name for p in RESULTS.iterdir() if not p.name.startswith(".")}
    missing = sorted(present - indexed)
    assert not missing, f"in benchmarks/results/ but not in its README.md index: {missing}"


def test_every_row_names_a_result_that_exists_once() -> None:
    rows = _index()
    gone = sorted(n for n in rows if not (RESULTS / n).exists())
    assert not gone, f"benchmarks/results/README.md has rows for entries that do not exist: {gone}"
    twice = sorted({n for n in rows if rows.count(n) > 1})
    assert not twice, f"benchmarks/results/README.md has more than one row for: {twice}"


def test_every_file_name_in_the_readme_exists() -> None:
    top = {p.name for p in RESULTS.iterdir()}
    deep = {str(p.relative_to(RESULTS)) for p in RESULTS.rglob("*")}
    unmatched = []
    for token in set(TICKED.findall(README.read_text())):
        token = token.rstrip("/")
        if token.startswith("."):
            continue  # an elided name ("..._in_situ.txt") or an extension alone
        head = token.split("/", 1)[0]
        if "/" in token and not any(fnmatch.fnmatch(t, e) for e in _expand(head) for t in top):
            continue  # a path outside results/ (docs/..., benchmarks/..., src/...)
        if "/" not in token and not all(e.endswith(RESULT_EXT + (".*",)) for e in _expand(token)):
            continue  # code, a codec spec, a script name
        names = deep if "/" in token else top | {Path(n).name for n in deep}  # or a study folder's file
        if not any(fnmatch.fnmatch(n, e) for e in _expand(token) for n in names):
            unmatched.append(token)
    assert not unmatched, f"benchmarks/results/README.md names files that are not there: {sorted(unmatched)}"
