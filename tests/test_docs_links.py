"""The README and docs/ name only files that exist in the repository (issue 23: the
README linked the design outside it, ``../shared/spec/...``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A code span naming a repository file: a top-level folder of this repository, or a
# document, or anything reaching out of the repository (../).
TOP = ("runtime/", "tests/", "scripts/", "kernels/", "configs/", "docs/", ".ci/", "../")
SPAN = re.compile(r"`([^`\s]+)`")


def _named_files(document: Path) -> list[str]:
    names = []
    for span in SPAN.findall(document.read_text(encoding="utf-8")):
        name = span.split("::", 1)[0].rstrip(".,:;)")
        if name.startswith(TOP) or (name.endswith(".md") and "/" not in name):
            names.append(name)
    return names


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.name)
def test_every_file_a_document_names_is_in_the_repository(document: Path) -> None:
    missing = []
    for name in _named_files(document):
        if name.startswith("../"):
            missing.append(f"{name} (outside the repository)")
            continue
        if "*" in name:  # a pattern: it must match something
            if not any(ROOT.glob(name)):
                missing.append(name)
            continue
        here = (document.parent / name) if not name.startswith(TOP) else (ROOT / name)
        candidates = [here, ROOT / name, ROOT / "docs" / name]
        if not any(c.exists() or Path(str(c).rstrip("/")).exists() for c in candidates):
            missing.append(name)
    assert missing == [], f"{document.name} names files that do not exist: {missing}"
