"""Every relative markdown link in docs/*.md and README.md resolves: the file exists, and a `#anchor`
names a heading of that file (GitHub's rule: lowercase, punctuation dropped, spaces to '-', a repeated
heading gets -1, -2, ...). The guide pages point to docs/results.md's sections for their numbers; a
renamed section fails here instead of leaving a dead link."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*```")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _slug(heading: str) -> str:
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)  # GitHub keeps letters, digits, '_', '-' and spaces
    return text.replace(" ", "-")


def _lines_outside_code(path: Path) -> list[str]:
    lines, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    """The anchors GitHub makes for the headings of one markdown file."""
    seen: dict[str, int] = {}
    out = set()
    for line in _lines_outside_code(path):
        m = HEADING.match(line)
        if not m:
            continue
        slug = _slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def dead_links(path: Path) -> list[str]:
    """The relative links of one page whose file or anchor does not exist."""
    dead = []
    for line in _lines_outside_code(path):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            if not dest.exists():
                dead.append(f"{target} (no file {_shown(dest)})")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                dead.append(f"{target} (no heading '#{anchor}' in {_shown(dest)})")
    return dead


def test_slug_follows_githubs_rule():
    assert _slug("DDP with `codec=\"auto\"`") == "ddp-with-codecauto"
    assert _slug("Both levels against issue 29's targets (2x and 4x H200, at 291ba16)") == (
        "both-levels-against-issue-29s-targets-2x-and-4x-h200-at-291ba16")
    assert _slug("Time to accuracy (GPU, partial)") == "time-to-accuracy-gpu-partial"


def test_dead_links_are_found(tmp_path):
    page = tmp_path / "a.md"
    (tmp_path / "b.md").write_text("# Real heading\n\n## Twice\n\n## Twice\n")
    page.write_text("[ok](b.md#real-heading) [ok2](b.md#twice-1) [gone](b.md#nope) [nofile](c.md)\n"
                    "```\n[in code](c.md)\n```\n")
    assert [d.split(" ")[0] for d in dead_links(page)] == ["b.md#nope", "c.md"]


def test_every_relative_link_and_anchor_in_the_docs_resolves():
    assert len(PAGES) > 5
    dead = {str(p.relative_to(ROOT)): d for p in PAGES if (d := dead_links(p))}
    assert not dead, f"dead links: {dead}"
