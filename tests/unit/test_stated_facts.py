"""Facts the package metadata and the docs state about the code, checked so they cannot go stale (issue 30, c).

* ``pyproject.toml``'s description names the ZeRO stages ds_muon serves (``ds_muon.config.sections.SERVED_STAGES``);
* a count of tests (``N tests``, ``N passed``) in the README or docs is a measurement: it stands in a sentence that
  gives its date (YYYY-MM-DD), never as a bare present-tense claim that the next test added makes wrong;
* ``pyproject.toml``'s license (Apache-2.0) is the text of ``LICENSE``, and the package ships that file.
"""
from __future__ import annotations

import hashlib
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


#: SHA-256 of the Apache License 2.0 as the Apache Software Foundation publishes it (LICENSE-2.0.txt, 11357 bytes:
#: the same bytes as DeepSpeed's, Accelerate's and PEFT's LICENSE files, and Debian's
#: /usr/share/common-licenses/Apache-2.0 less its leading blank line).
APACHE_2_SHA256 = "c71d239df91726fc519c6eb72d318ec65820627232b2f796219e87dcf35d0ab4"


def test_license_file_is_the_apache_2_text_and_is_shipped():
    """pyproject.toml says Apache-2.0 (an SPDX expression) and names LICENSE in ``license-files`` (so wheels and
    sdists carry it, ``License-File: LICENSE``); LICENSE is the unmodified Apache License 2.0."""
    text = (REPO / "pyproject.toml").read_text()  # read as text: an older setuptools rejects the SPDX string
    project = text[text.index("[project]"):text.index("\n[", text.index("[project]") + 1)]
    assert re.search(r'^license = "Apache-2.0"$', project, re.M), project
    assert re.search(r'^license-files = \["LICENSE"\]$', project, re.M), project
    text = (REPO / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_SHA256, "LICENSE is not the unmodified Apache License 2.0"
