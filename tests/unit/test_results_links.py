"""bench/RESULTS.md names only result files that exist, and its links resolve.

RESULTS.md shows the latest run of each benchmark and ``bench/results/`` keeps those runs' files;
superseded files are deleted (git keeps them, HISTORY.md says where). A pruning that removes a
file RESULTS.md still quotes, or a renamed section the contents table links to, fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
BENCH = REPO_ROOT / "bench"
RESULTS = BENCH / "RESULTS.md"
#: a ``bench/results/...`` path as the text names it (a folder, a file, or a glob like run4_*)
RESULT_PATH_RE = re.compile(r"bench/results/[\w./*-]*[\w/*]")
LINK_RE = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def named_result_paths(text: str) -> list[str]:
    return sorted(set(RESULT_PATH_RE.findall(text)))


def test_results_names_result_files() -> None:
    paths = named_result_paths(RESULTS.read_text())
    assert len(paths) >= 10, paths  # the check reads what it should
    missing = [p for p in paths if not (list(REPO_ROOT.glob(p)) if "*" in p
                                       else (REPO_ROOT / p).exists())]
    assert not missing, f"RESULTS.md names result files that do not exist: {missing}"


def test_results_and_history_links_resolve() -> None:
    for page in (RESULTS, BENCH / "HISTORY.md"):
        text = page.read_text()
        anchors = {re.sub(r"[^\w\- ]", "", m.strip().lower()).replace(" ", "-")
                   for m in re.findall(r"^#{1,6}\s+(.*?)\s*$", text, re.MULTILINE)}
        for target in LINK_RE.findall(text):
            path, _, fragment = target.partition("#")
            if path:
                assert (page.parent / path).exists(), f"{page.name}: broken link {target}"
            elif fragment:
                assert fragment in anchors, f"{page.name}: no heading for #{fragment}"


def test_results_opens_with_the_current_tables() -> None:
    """Current-first: each benchmark once, the narrative in HISTORY.md."""
    text = RESULTS.read_text()
    sections = re.findall(r"^## (.*)$", text, re.MULTILINE)
    assert len(sections) == len(set(sections)) >= 15
    assert len(text.splitlines()) <= 600
    assert "### Pass" not in text and "[HISTORY.md](HISTORY.md)" in text


def test_the_pattern_finds_paths() -> None:
    text = "files `bench/results/block_chunks/run4_*` and bench/results/soak/. end"
    assert named_result_paths(text) == ["bench/results/block_chunks/run4_*",
                                        "bench/results/soak/"]
