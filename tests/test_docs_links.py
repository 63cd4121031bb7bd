"""Every relative link in README.md and the written pages of docs/ points at a file or directory that
exists (inline links, images and reference definitions; code blocks and code spans are not links). The raw
output folders under docs/results/ (evaluate.py's reports as they were written, next to the figures that
were kept) are records, not pages, and are left out. Negative control: a page with a broken link, in a
temporary directory, is reported."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.DOTALL)
INLINE = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+[\"'(][^)]*)?\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.MULTILINE)


def pages(root: Path = REPO) -> list[Path]:
    """README.md and docs/**/*.md, except what lies in a folder under docs/results/ (raw outputs)."""
    results = root / "docs" / "results"
    written = [p for p in (root / "docs").rglob("*.md") if results not in p.parent.parents]
    return [root / "README.md", *sorted(written)]


def links(text: str) -> list[str]:
    """The link targets of a markdown text, outside fenced code blocks and code spans (a code span inside
    a link's text, as in [`docs/x.md`](docs/x.md), leaves the target intact)."""
    text = CODE_SPAN.sub("``", FENCE.sub("", text))
    text = "\n".join(line for line in text.splitlines() if not line.startswith("    "))  # indented code
    return INLINE.findall(text) + REFERENCE.findall(text)


def broken_links(page: Path, root: Path = REPO) -> list[str]:
    """The relative link targets of ``page`` that name no existing path (anchors and query strings are
    dropped; URLs, mailto: and in-page anchors are not checked)."""
    bad = []
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("#"):
            continue
        path = unquote(re.split(r"[#?]", target, maxsplit=1)[0])
        resolved = root / path.lstrip("/") if path.startswith("/") else page.parent / path
        if not resolved.exists():
            bad.append(target)
    return bad


def test_every_relative_link_in_readme_and_docs_resolves():
    assert (REPO / "README.md").is_file() and len(pages()) > 2
    broken = {str(p.relative_to(REPO)): bad for p in pages() if (bad := broken_links(p))}
    assert broken == {}


def test_the_readme_links_the_docs():
    assert {"docs/usage.md", "docs/architecture.md", "docs/results/README.md"} <= set(
        links((REPO / "README.md").read_text(encoding="utf-8"))
    )


def test_a_broken_link_is_reported(tmp_path):
    """Negative control: the same check on a temporary tree reports the missing targets and only them."""
    (tmp_path / "docs" / "sub").mkdir(parents=True)
    (tmp_path / "docs" / "sub" / "there.md").write_text("# there\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "[ok](sub/there.md#a-heading) [`ok too`](sub/there.md) ![img](missing.png) [web](https://example.com)\n"
        "[anchor](#x) [gone](sub/gone.md) [root](/docs/sub/there.md) `[in code](nowhere.md)`\n\n"
        "```\n[fenced](nowhere.md)\n```\n\n    [indented](nowhere.md)\n\n[ref]: ../docs/lost.md\n"
    )
    assert broken_links(page, root=tmp_path) == ["missing.png", "sub/gone.md", "../docs/lost.md"]
