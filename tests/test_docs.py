"""The README and docs/ say only what the code has: every `moejax VERB --flag` they write is one
the verb's parser takes, every link resolves, and the README stays a front page."""

import argparse
import re
from pathlib import Path

import pytest

from moejax.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 200


def _verb_options() -> dict[str, set[str]]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {verb: set(p._option_string_actions) for verb, p in sub.choices.items()}


def _commands(text: str):
    """Each `moejax VERB ...` command written in a page, continuation lines joined."""
    text = re.sub(r"\\\n\s*", " ", text)
    for m in re.finditer(r"moejax ([a-z]+)((?: +[^\s`#|)]+)*)", text):
        yield m.group(1), m.group(2)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_flag_written_is_one_the_verb_takes(page):
    options = _verb_options()
    wrong = []
    for verb, rest in _commands(page.read_text()):
        if verb not in options:
            continue  # prose such as "moejax serves"; verbs are checked by the flags they carry
        wrong += [
            f"moejax {verb} {flag}"
            for flag in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", rest)
            if flag not in options[verb]
        ]
    assert not wrong, f"{page.name}: flags the parser does not take: {wrong}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", page.read_text())
    missing = [link for link in links if "://" not in link and not (page.parent / link).exists()]
    assert not missing, f"{page.name}: links to nothing: {missing}"


def test_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


def test_references_name_both_articles():
    text = (ROOT / "docs" / "references.md").read_text()
    assert "How a Row Meets Its Experts" in text and "Anatomy of a large-MoE decode step" in text


def test_nothing_points_outside_the_repository():
    outside = "../" + "shared"  # spelled in two so that this file does not name it
    for path in [*PAGES, *ROOT.glob("*/**/*.py")]:
        assert outside not in path.read_text(), path


# An internal number standing for a source (a numbered seed document, a tracker entry, a session
# stop) or an unnamed article; a random seed ("seed 0", "seed S + i") is not one. Spelled in parts
# so that this file does not match itself.
_SEED, _ISSUE, _STOP, _ARTICLE = "seed", "issue", "stop", "the " + "article"
CITATION = re.compile(
    rf"\b{_SEED} [12]\b(?! *[+*-])|\b{_ISSUE} [0-9]+|\b{_STOP} [0-9]+\b|\b{_ARTICLE}\b", re.IGNORECASE
)


def test_code_and_docs_cite_references_by_name():
    """Sources are cited by their short names in docs/references.md, never by an internal number."""
    found = [
        f"{path.relative_to(ROOT)}:{i}"
        for path in [*PAGES, *ROOT.glob("*/**/*.py")]
        if path.name != "test_docs.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if CITATION.search(line)
    ]
    assert not found, found
