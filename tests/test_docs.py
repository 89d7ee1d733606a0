"""The README stays a front page and the docs stay connected: README.md is at most 200 lines,
every relative link in README.md and docs/*.md reaches a file (and, with #anchor, a heading
of it), and every flag in a ```bash line that runs experiments.train is one the trainer takes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
CODE_SPAN = re.compile(r"`+[^`]*`+")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
TRAIN = re.compile(r"experiments\.train\b")
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*")


def _name(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def prose_lines(text: str) -> list[str]:
    """The lines of a markdown text outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def bash_blocks(text: str) -> list[list[str]]:
    """The lines of each ```bash fenced block, backslash continuations joined into one line."""
    blocks, current, fenced = [], None, False
    for line in text.splitlines():
        if FENCE.match(line):
            if not fenced and line.strip().lstrip("`~").strip().startswith(("bash", "sh", "shell")):
                current = []
            elif fenced and current is not None:
                blocks.append(current)
                current = None
            fenced = not fenced
            continue
        if current is not None:
            if current and current[-1].endswith("\\"):
                current[-1] = current[-1][:-1] + " " + line.strip()
            else:
                current.append(line)
    return blocks


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page's headings, repeated ones numbered as GitHub numbers them."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        found.add(base if n == 0 else f"{base}-{n}")
    return found


def test_slug_is_githubs() -> None:
    assert slug("Gradient reduction under accumulation (`--grad-sync`)") == (
        "gradient-reduction-under-accumulation---grad-sync"
    )
    assert slug("Hybrid sharding and ZeRO++") == "hybrid-sharding-and-zero"
    assert slug("4. At stage 3: evaluate and save on every rank") == "4-at-stage-3-evaluate-and-save-on-every-rank"


def test_readme_is_a_front_page() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; move detail into docs/ (at most 200)"


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for line in prose_lines(page.read_text(encoding="utf-8")):
        for target in LINK.findall(CODE_SPAN.sub("", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{target}: no file {_name(dest)}")
            elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
                broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{_name(page)}: broken links: {broken}"


@pytest.fixture(scope="module")
def trainer_flags() -> set[str]:
    from research.config import build_parser

    return {s for action in build_parser()._actions for s in action.option_strings}


def test_the_flag_scan_finds_the_set_up_command(trainer_flags: set[str]) -> None:
    lines = [
        line
        for block in bash_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
        for line in block
        if TRAIN.search(line)
    ]
    assert lines, "no experiments.train command in README.md's bash blocks"
    assert {"--tp", "--pp", "--zero", "--config"} <= trainer_flags


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_train_commands_use_real_flags(page: Path, trainer_flags: set[str]) -> None:
    unknown = []
    for block in bash_blocks(page.read_text(encoding="utf-8")):
        for line in block:
            m = TRAIN.search(line)
            if not m or "..." in line:
                continue
            args = line[m.end() :].split(" #", 1)[0]  # the trainer's own arguments, not torchrun's or a comment
            unknown += [f"{flag} in: {line.strip()}" for flag in FLAG.findall(args) if flag not in trainer_flags]
    assert not unknown, f"{_name(page)}: flags experiments.train does not take: {unknown}"
