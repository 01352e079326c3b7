"""The prose of README.md and docs/ reads plainly: no sentence over 40 words, and no word of the project's own
plumbing (its machine, its sessions, its issue numbers) outside code spans.

Sentences are counted in prose only: fenced code, tables, headings and lines of HTML are left out, an inline code
span counts as one word and a link as its text. A sentence ends at . ! or ? followed by a space or a line end; a
list item starts a new one. The internal words are looked for everywhere outside fenced code and code spans."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").rglob("*.md"))
MAX_WORDS = 40

FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
LIST_ITEM = re.compile(r"^\s*(?:[-*+]|\d+[.)])\s+")
SENTENCE_END = re.compile(r"(?<=[.!?])[\"')\]*_]*\s+")
WORD = re.compile(r"\w")
INTERNAL = re.compile(
    r"this project's (?:\S+ )?(?:machine|CPU|GPU|box)|machine of this project|\bSession \d+|\bissues? #?\d+"
    r"|(?<![\w&/#])#\d+\b|\brooms?\b|\blent\b|\bfloors\b",
    re.I,
)


def paragraphs(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each paragraph of `text` outside fenced code blocks (blank lines and fences
    end a paragraph)."""
    found: list[tuple[int, list[str]]] = []
    fenced, start, lines = False, 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line) or fenced or not line.strip():
            if lines:
                found.append((start, lines))
            lines = []
            fenced ^= bool(FENCE.match(line))
            continue
        if not lines:
            start = number
        lines.append(line)
    if lines:
        found.append((start, lines))
    return found


def is_prose(line: str) -> bool:
    """Not a table row, a heading, a line of HTML, an admonition's marker or a mkdocstrings directive."""
    stripped = line.strip()
    return not stripped.startswith(("|", "#", "<", "!!!", ":::"))


def without_code(text: str) -> str:
    """`text` with each inline code span replaced by one word (the line breaks inside it kept)."""
    return CODE_SPAN.sub(lambda m: "code" + "\n" * m.group(0).count("\n"), text)


def sentences(text: str) -> list[tuple[int, str]]:
    """(first line, sentence) of the prose of `text`: paragraphs joined over lines, split at sentence ends and
    list items, code spans replaced by one word and links by their text."""
    found: list[tuple[int, str]] = []
    for start, lines in paragraphs(text):
        chunks: list[tuple[int, list[str]]] = []  # runs of prose lines, a list item starting a new one
        for offset, line in enumerate(lines):
            if not is_prose(line):
                chunks.append((0, []))
                continue
            if LIST_ITEM.match(line) or not chunks or not chunks[-1][1]:
                chunks.append((start + offset, []))
            chunks[-1][1].append(line.strip())
        for first, chunk in chunks:
            plain = LINK.sub(r"\1", without_code(" ".join(chunk)).replace("\n", " "))
            found.extend((first, s) for s in SENTENCE_END.split(plain) if s.strip())
    return found


def word_count(sentence: str) -> int:
    return sum(1 for token in sentence.split() if WORD.search(token))


def long_sentences(text: str) -> list[str]:
    return [f"line {n}: {word_count(s)} words: {s}" for n, s in sentences(text) if word_count(s) > MAX_WORDS]


def internal_words(text: str) -> list[str]:
    """Internal words outside fenced code and code spans (tables and headings included)."""
    found = []
    for start, lines in paragraphs(text):
        plain = without_code("\n".join(lines))
        for match in INTERNAL.finditer(plain):
            number = start + plain.count("\n", 0, match.start())
            found.append(f"line {number}: {match.group(0)!r}: {lines[number - start].strip()}")
    return found


def offenders(path: Path) -> list[str]:
    text = path.read_text()
    return long_sentences(text) + internal_words(text)


README_OFFENDERS = offenders(README)


@pytest.mark.parametrize("page", DOCS, ids=[p.relative_to(ROOT).as_posix() for p in DOCS])
def test_docs_prose_is_plain(page: Path) -> None:
    found = offenders(page)
    assert not found, "\n".join(found)


def test_readme_prose_is_plain() -> None:
    assert not README_OFFENDERS, "\n".join(README_OFFENDERS)


def test_the_checker_flags_and_passes_what_it_should() -> None:
    long = " ".join(["word"] * 41) + "."
    assert long_sentences(long) and not long_sentences(" ".join(["word"] * 40) + ".")
    assert not long_sentences(long.replace("word word", "word. Word", 1))  # two sentences
    assert not long_sentences(f"- {' '.join(['word'] * 20)}\n- {' '.join(['word'] * 30)}")  # two list items
    assert not long_sentences(f"| {' | '.join(['word word'] * 30)} |")  # a table row
    assert not long_sentences(f"A call `{' '.join(['word'] * 45)}` runs.")  # a code span is one word
    assert not long_sentences(f"```python\n{' '.join(['word'] * 45)}\n```")  # fenced code
    assert long_sentences(f"- {' '.join(['word'] * 25)}\n  {' '.join(['word'] * 20)}.")  # an item's next line
    assert not long_sentences(f"# {' '.join(['word'] * 45)}")  # a heading
    for internal in ("It ran on this project's machine.", "Since Session 12 it does.", "See issue 14.",
                     "Fixed in #56.", "The rooms were full.", "The GPU was lent.", "Version floors hold."):
        assert internal_words(internal), internal
    assert not internal_words("The versions are pinned in `.ci/floors` and tested with `#56`.")
    assert not internal_words("```bash\ncat .ci/floors  # issue 14\n```")
    assert not internal_words("Run `bash\n.ci/floors` first.")  # a code span over two lines
    assert internal_words("| measured on | this project's machine |")  # tables are read for internal words
    assert not internal_words("See [batches](../guides/generate.md#continuous-batching-generate_batch).")
