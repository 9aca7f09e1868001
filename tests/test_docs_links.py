"""Every doc stands alone: it links only to files of this repository or to
public URLs, names no folder of a particular machine and no internal issue.

Checked in README.md, docs/*.md, configs/**/*.yaml and pyproject.toml:
Markdown links, and repository paths written as `docs/...`, `fedaccel/...`,
`tests/...`, `bench/...`, `scripts/...` or `configs/...` (placeholders with
``<``, ``*`` or ``{`` are left alone).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "pyproject.toml", *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "configs").rglob("*.yaml"))]
REPO_PATH = re.compile(r"(?<![\w/.-])((?:docs|fedaccel|tests|bench|scripts|configs)/[\w./<>*{}-]*[\w/>}*])")
MACHINE_PATH = re.compile(r"(?<![\w.])(/work/|/root/|/home/\w|/Users/\w|\.\./shared)")
ISSUE = re.compile(r"\b[Ii]ssues? ?#?\d+|(?<![\w&/])#\d+\b")


def doc_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_links_and_paths_point_into_the_repository(doc):
    text = doc.read_text(encoding="utf-8")
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        target = target.split("#")[0]
        if target and not re.match(r"https?://", target) and not (doc.parent / target).exists():
            missing.append(target)
    for path in REPO_PATH.findall(text):
        if not any(c in path for c in "<*{") and not (ROOT / path.split(":")[0]).exists():
            missing.append(path)
    assert not missing, f"{doc_id(doc)} names files that are not in the repository: {sorted(set(missing))}"


@pytest.mark.parametrize("doc", DOCS, ids=doc_id)
def test_no_machine_paths_or_internal_issue_numbers(doc):
    text = doc.read_text(encoding="utf-8")
    found = MACHINE_PATH.findall(text) + ISSUE.findall(text)
    assert not found, f"{doc_id(doc)}: {found}"
