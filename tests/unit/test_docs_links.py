"""Every relative link in README.md and docs/*.md resolves: the file exists, and so does the anchor.

Anchors are computed as GitHub renders headings (lower case, punctuation dropped, spaces to
hyphens, ``-1``, ``-2`` ... for repeats), so a renamed heading breaks the test, not the reader.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) outside inline code; images too. Targets with a scheme are not ours to check.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:", re.IGNORECASE)


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks and HTML comments."""
    out, in_fence = [], False
    for line in re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL).splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        if not in_fence:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    text = text.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor a page's headings make."""
    seen: Counter[str] = Counter()
    out = set()
    for line in prose_lines(path.read_text()):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        out.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return out


def links(path: Path) -> list[str]:
    """Relative link targets of a page, inline code removed first."""
    found = []
    for line in prose_lines(path.read_text()):
        found.extend(LINK.findall(re.sub(r"`[^`]*`", "", line)))
    return [t for t in found if not SCHEME.match(t)]


def test_slug_matches_github() -> None:
    assert slug("Lost, corrupt and foreign records; IPAM cleanup that failed") == (
        "lost-corrupt-and-foreign-records-ipam-cleanup-that-failed"
    )
    assert slug("1. Prepare each node") == "1-prepare-each-node"
    assert slug("Who may own `stateDir` and lockFile") == "who-may-own-statedir-and-lockfile"
    assert slug("The installer and node agent's options") == "the-installer-and-node-agents-options"


def test_links_are_found_outside_code_only() -> None:
    page = ROOT / "build" / "links-probe.md"
    page.parent.mkdir(exist_ok=True)
    page.write_text("[a](x.md) `[b](y.md)`\n```\n[c](z.md)\n```\n<!-- [d](w.md) -->\n[e](https://e)\n")
    try:
        assert links(page) == ["x.md"]
    finally:
        page.unlink()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading makes #{anchor} in {dest.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_every_docs_page_is_in_the_index() -> None:
    index = {t.partition("#")[0] for t in links(ROOT / "docs" / "README.md")}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= index, f"not listed in docs/README.md: {sorted(pages - index)}"
