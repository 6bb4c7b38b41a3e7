"""README.md is a front door and docs/ holds the rest: the README stays short, links every page
of docs/, and no relative link in either points at a file that is not there."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_LINES = 200

# [text](target) and ![alt](target); the target ends at whitespace or ")" (an optional
# "title" after it is ignored). Code spans and fenced blocks are removed first.
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`[^`]+`")  # a code span may run over a line break, as in markdown


def links(path: pathlib.Path) -> list[str]:
    text = CODE_SPAN.sub("", FENCE.sub("", path.read_text(encoding="utf-8")))
    return LINK.findall(text)


def relative_targets(path: pathlib.Path) -> list[str]:
    out = []
    for target in links(path):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
            continue  # http(s), mailto: not files of the tree
        target = target.split("#", 1)[0]
        if target:  # "#anchor" alone points into the same page
            out.append(target)
    return out


def test_readme_is_at_most_200_lines():
    n = len(README.read_text(encoding="utf-8").splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; move detail into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    assert DOCS, "docs/ has no pages"
    linked = {(README.parent / t).resolve() for t in relative_targets(README)}
    missing = [p.name for p in DOCS if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_to_files(page):
    broken = [t for t in relative_targets(page) if not (page.parent / t).is_file()]
    assert not broken, f"{page.relative_to(ROOT)} links to missing files: {broken}"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, code marks and punctuation dropped (hyphens
    and underscores kept), spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def anchors(path: pathlib.Path) -> set[str]:
    """The anchors of a page's headings (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", path.read_text(encoding="utf-8")).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def test_slug_is_githubs():
    assert slug("Warmup and token buckets") == "warmup-and-token-buckets"
    assert slug("`cpu`: the C++ kernels") == "cpu-the-c-kernels"
    assert slug("On a GPU (first run, 2026-11-30)") == "on-a-gpu-first-run-2026-11-30"
    assert slug("Deviations from vLLM, and why") == "deviations-from-vllm-and-why"


@pytest.mark.parametrize("page", [README, *DOCS], ids=lambda p: str(p.relative_to(ROOT)))
def test_anchors_point_to_headings(page):
    broken = []
    for target in links(page):
        if "#" not in target or re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):
            continue
        file, anchor = target.split("#", 1)
        dest = (page.parent / file) if file else page
        if dest.suffix == ".md" and dest.is_file() and anchor not in anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)} links to missing headings: {broken}"
