"""Fenced code blocks of README.md and docs/*.md, with the marker that says how each is checked.

A marker is an HTML comment on the line just above a block's opening fence (blank lines
between are allowed), ``<!-- kind: value -->``:

- ``norun: reason``: cannot run on a development machine (a real cluster, a real NIC, a reboot);
- ``requires: tool /path ... (reason)``: runs only where each command is on PATH and each
  absolute path exists, and is skipped, visibly, elsewhere;
- ``tested-by: path::test``: another test runs it (it must exist and read the page);
- ``run: in an empty directory``: runs, in a fresh directory instead of the repository;
- ``synopsis: command``: a ``text`` block listing a subcommand's options.

A shell block (``sh``, ``bash``, ``shell``, ``console``) without a marker runs from the
repository as written.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SHELL_LANGS = frozenset({"sh", "bash", "shell", "console"})
MARKER_KINDS = frozenset({"norun", "requires", "tested-by", "run", "synopsis"})

_FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>```+|~~~+)\s*(?P<info>.*)$")
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>[a-z-]+):\s*(?P<value>.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language, its text (indentation removed), its marker."""

    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    text: str
    marker: str | None  # the marker's kind, or None
    value: str  # the marker's value ("" without one)

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def is_shell(self) -> bool:
        return self.lang in SHELL_LANGS


def pages() -> list[Path]:
    """The README and every page of docs/."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    """Every fenced block of a page, in order."""
    lines = page.read_text().splitlines()
    out: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m.group("indent")), m.group("fence")
        lang = m.group("info").split()[0] if m.group("info") else ""
        body: list[str] = []
        j = i + 1
        while j < len(lines) and lines[j].strip() != fence:
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        marker, value = None, ""
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        if k >= 0 and (mm := _MARKER.match(lines[k])):
            marker, value = mm.group("kind"), mm.group("value")
        out.append(Block(page, i + 1, lang, "\n".join(body) + "\n", marker, value))
        i = j + 1
    return out


def all_blocks() -> list[Block]:
    """Every fenced block of the README and docs/."""
    return [b for page in pages() for b in blocks(page)]


def console_steps(block: Block) -> list[tuple[str, str]]:
    """A console block as (command, expected output) pairs: ``$ `` starts a command."""
    steps: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:], []))
        elif steps:
            steps[-1][1].append(line)
        elif line.strip():
            raise ValueError(f"{block.where}: output before the first '$ ' command")
    return [(command, "\n".join(output).rstrip("\n")) for command, output in steps]
