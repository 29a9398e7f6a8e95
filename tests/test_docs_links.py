"""Every relative link of the repository's markdown (README, docs/, results/, benchmarks/) names a file that
exists, and every #anchor a heading of that file, slugged as GitHub does (lower case, punctuation but - and _
dropped, spaces to -, a repeated heading numbered -1, -2, ...)."""

import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def markdown_files() -> list[Path]:
    files = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "results").rglob("*.md")),
             *sorted((REPO / "benchmarks").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def anchors(path: Path) -> Iterator[str]:
    seen: dict[str, int] = {}
    for line in FENCE.sub("", path.read_text()).splitlines():
        if not re.match(r"#{1,6} ", line):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        yield slug if count == 0 else f"{slug}-{count}"


@cache
def anchor_set(path: Path) -> frozenset[str]:  # a page's anchors, parsed once however many links name it
    return frozenset(anchors(path))


def test_every_relative_link_and_anchor_resolves():
    broken = []
    for page in markdown_files():
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):  # https:, mailto: ...
                continue
            file, _, anchor = target.partition("#")
            path = (page.parent / file).resolve() if file else page
            where = f"{page.relative_to(REPO)}: {target}"
            if not path.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and path.suffix == ".md" and anchor not in anchor_set(path):
                broken.append(f"{where} (no heading #{anchor})")
    assert not broken, "\n".join(broken)


def test_the_slugs_follow_githubs_rule(tmp_path):
    page = tmp_path / "a.md"
    page.write_text("# Stop, resume and exit statuses\n## `train.py --dry-run`\n## Notes\n## Notes\n"
                    "```\n# not a heading\n```\n")
    assert list(anchors(page)) == ["stop-resume-and-exit-statuses", "trainpy---dry-run", "notes", "notes-1"]


def test_no_table_is_cut_by_a_blank_line():
    """A blank line inside a markdown table ends it: the rows after it render as text (the exit-status row for 130
    in docs/training.md, the Engram row in docs/variants.md: issue 63). A table row after a blank line that follows
    a table row must start a new table (its separator line next)."""
    cut = []
    for page in markdown_files():
        lines = FENCE.sub("", page.read_text()).splitlines()
        for i in range(1, len(lines) - 1):
            if not lines[i].strip() and lines[i - 1].startswith("|") and lines[i + 1].startswith("|") and not (
                    i + 2 < len(lines) and re.match(r"\|\s*:?-", lines[i + 2])):
                cut.append(f"{page.relative_to(REPO)}: {lines[i + 1][:60]}")
    assert not cut, cut
