"""Every ``Note [Title]`` the code refers to is defined somewhere in the repository.

Design decisions live in ``# Note [Title]`` comment blocks, and code points back to them with
``See Note [Title]``. A merge or a move can drop a Note and leave its references dangling
(one was found that way), so the references are checked.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_DEFINITION = re.compile(r"^\s*#\s*Note \[([^\]]+)\]\s*$", re.MULTILINE)
_REFERENCE = re.compile(r"Note \[([^\]]+)\]")


def _sources() -> list[Path]:
    files = [ROOT / "README.md"]
    for folder in ("ckpt_graph", "tests", "benchmarks", "examples"):
        files += sorted((ROOT / folder).rglob("*.py"))
    return [p for p in files if p.resolve() != Path(__file__).resolve()]  # not this file's forms


def _flat(text: str) -> str:
    """The text with comment continuations joined, so a reference wrapped over lines reads
    as one."""
    return re.sub(r"\s+", " ", re.sub(r"\n\s*#", " ", text))


def test_every_note_reference_has_a_definition() -> None:
    texts = {p: p.read_text() for p in _sources()}
    defined = {m.group(1) for text in texts.values() for m in _DEFINITION.finditer(text)}
    dangling = sorted(
        f"{p.relative_to(ROOT)}: Note [{title}]"
        for p, text in texts.items()
        for title in {m.group(1) for m in _REFERENCE.finditer(_flat(text))}
        if title not in defined and title != "..."  # the README shows the form
    )
    assert not dangling, "references to Notes defined nowhere:\n" + "\n".join(dangling)


def test_notes_are_defined_once() -> None:
    seen: dict[str, Path] = {}
    twice = []
    for p in _sources():
        for m in _DEFINITION.finditer(p.read_text()):
            if m.group(1) in seen and seen[m.group(1)] != p:
                twice.append(f"Note [{m.group(1)}]: {seen[m.group(1)]} and {p}")
            seen.setdefault(m.group(1), p)
    assert not twice, "\n".join(twice)
