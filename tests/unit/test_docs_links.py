"""Every relative link of the README, docs/ and the folder guides points to a file that exists
(and, with a ``#fragment``, to a heading of that file): pages move, links must follow."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [REPO_ROOT / "README.md", REPO_ROOT / "connector" / "README.md"]
    + list((REPO_ROOT / "docs").glob("*.md"))
)
#: ``[text](target)``, outside code spans; images too.
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^```.*?^```", re.DOTALL | re.MULTILINE)
CODE_SPAN_RE = re.compile(r"`[^`\n]*`")


def relative_links(text: str) -> list[str]:
    """Link targets that name a path in this repository (no scheme, no mail)."""
    text = CODE_SPAN_RE.sub("", FENCE_RE.sub("", text))
    return [t for t in LINK_RE.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def heading_anchors(text: str) -> set[str]:
    """GitHub's anchors of a markdown page's headings (lowercase, punctuation dropped)."""
    anchors = set()
    for line in FENCE_RE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*$", line)
        if m:
            title = m.group(1).strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_the_pages_exist() -> None:
    assert all(page.is_file() for page in PAGES)
    assert len(PAGES) > 3


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    broken = []
    for target in relative_links(text):
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and dest.suffix == ".md":
            if fragment not in heading_anchors(dest.read_text(encoding="utf-8")):
                broken.append(f"{target} (no heading #{fragment})")
    assert not broken, f"{page.relative_to(REPO_ROOT)}: broken links {broken}"


def test_the_checker_sees_broken_links_and_skips_code() -> None:
    text = "[a](docs/x.md) [b](https://x.org) `[c](nope.md)`\n```\n[d](nope2.md)\n```\n![e](f.png)"
    assert relative_links(text) == ["docs/x.md", "f.png"]
    assert heading_anchors("# Connector configuration\n## Where it stands (now)") == {
        "connector-configuration", "where-it-stands-now",
    }
