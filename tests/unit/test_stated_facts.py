"""Facts the package metadata and the docs state about the code, checked so they cannot go stale (issue 30, c).

* ``pyproject.toml``'s description names the ZeRO stages ds_muon serves (``ds_muon.config.sections.SERVED_STAGES``);
* a count of tests (``N tests``, ``N passed``) in the README or docs is a measurement: it stands in a sentence that
  gives its date (YYYY-MM-DD), never as a bare present-tense claim that the next test added makes wrong.
"""
from __future__ import annotations

import re

from ds_muon.config.sections import MUON, SERVED_STAGES
from tests.support.tools import REPO


def _stages_phrase(stages) -> str:
    *head, last = [str(s) for s in stages]
    return f"stages {', '.join(head)} and {last}" if head else f"stage {last}"


def test_pyproject_description_names_the_served_stages():
    text = (REPO / "pyproject.toml").read_text()
    description = re.search(r'^description = "(.*)"$', text, re.M).group(1)
    assert f"ZeRO {_stages_phrase(SERVED_STAGES[MUON])}" in description, description


def test_test_counts_in_docs_are_dated():
    count = re.compile(r"\b\d{2,} (?:tests|passed)\b")
    date = re.compile(r"\b20\d\d-\d\d-\d\d\b")
    undated = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = " ".join(path.read_text().split())
        for sentence in re.split(r"(?<=[.!?])\s+(?=[A-Z`(])", text):
            if count.search(sentence) and not date.search(sentence):
                undated.append(f"{path.relative_to(REPO)}: {sentence[:200]}")
    assert not undated, "a test count without the date it was measured on:\n" + "\n".join(undated)
