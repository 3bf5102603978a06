"""Comments and docs point only at things in the repository.

* No tracked text file cites a design document, style guide or issue tracker
  that is not part of the repository (`DESIGN §n`, `STYLE.md`, `issue 5`,
  `issue: ...`). Published papers are fine ("Persia §4.2.3").
* Every relative link in README.md, deploy/README.md and docs/*.md names an
  existing file, and a `#section` in it names a heading of that file.
* Every `docs/<name>.md#section` mentioned in any tracked file names an
  existing heading.
"""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".proto", ".toml", ".txt", ".json", ".cfg", ".ini"}
SKIP_DIRS = {".git", ".venv", "__pycache__", "node_modules", ".pytest_cache"}
LINKED_DOCS = ["README.md", "deploy/README.md", "docs/*.md"]

# Each pattern is written so that this file does not match it.
FORBIDDEN = [
    (re.compile(r"\bDESIGN(?:\.md|\s*§)"), "a design document that is not in the repository"),
    (re.compile(r"\bSTYLE\.md|\(STYLE\b"), "a style guide that is not in the repository"),
    (re.compile(r"\bissues?\s+#?\d+", re.IGNORECASE), "an issue number"),
    (re.compile(r"\bissue:", re.IGNORECASE), "an issue reference"),
]
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")
DOC_ANCHOR = re.compile(r"\b(docs/[\w./-]+\.md)#([\w-]+)")


def tracked_files() -> list[Path]:
    """The repository's tracked files (git ls-files), or every file outside build and VCS folders."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
        files = [REPO / name for name in out.decode().split("\0") if name]
    except (OSError, subprocess.CalledProcessError):
        files = [p for p in REPO.rglob("*") if not SKIP_DIRS & set(p.relative_to(REPO).parts)]
    return [p for p in files if p.is_file()]


def is_text(path: Path) -> bool:
    if path.suffix in TEXT_SUFFIXES or path.name.startswith("Dockerfile"):
        return True
    try:  # scripts without a suffix (.ci/run)
        with open(path, "rb") as f:
            return f.read(2) == b"#!"
    except OSError:
        return False


def text_files() -> list[Path]:
    return [p for p in tracked_files() if is_text(p) and "_pb2" not in p.name]


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*?|__", "", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def outside_fences(text: str) -> list[tuple[int, str]]:
    """(line number, line) of every line not inside a fenced code block."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def anchors(path: Path) -> set[str]:
    found: set[str] = set()
    for _, line in outside_fences(path.read_text(encoding="utf-8")):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            name, n = base, 1
            while name in found:  # repeated headings get -1, -2, ...
                name, n = f"{base}-{n}", n + 1
            found.add(name)
    return found


def linked_docs() -> list[Path]:
    docs: list[Path] = []
    for pattern in LINKED_DOCS:
        docs.extend(sorted(REPO.glob(pattern)))
    return docs


def test_no_references_outside_the_repository():
    me = Path(__file__).resolve()
    bad = []
    for path in text_files():
        if path.resolve() == me:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for pattern, what in FORBIDDEN:
                if pattern.search(line):
                    bad.append(f"{path.relative_to(REPO)}:{number}: {what}: {line.strip()}")
    assert not bad, ("point to a file or section in the repository (docs/architecture.md, a module), "
                     "or state the fact:\n" + "\n".join(bad))


def test_the_linked_docs_exist():
    assert (REPO / "docs" / "architecture.md").is_file()
    assert "docs/architecture.md" in (REPO / "README.md").read_text(encoding="utf-8")


@pytest.mark.parametrize("doc", linked_docs(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_markdown_links_resolve(doc: Path):
    bad = []
    for number, line in outside_fences(doc.read_text(encoding="utf-8")):
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        for target in LINK.findall(line):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            path = (doc.parent / file_part).resolve() if file_part else doc
            if not path.exists():
                bad.append(f"{doc.relative_to(REPO)}:{number}: {target}: no such file")
            elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                bad.append(f"{doc.relative_to(REPO)}:{number}: {target}: no heading #{anchor} in {path.name}")
    assert not bad, "\n".join(bad)


def test_doc_sections_named_in_code_exist():
    bad = []
    for path in text_files():
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        for number, line in enumerate(text.splitlines(), 1):
            for doc, anchor in DOC_ANCHOR.findall(line):
                target = REPO / doc
                if not target.is_file():
                    bad.append(f"{path.relative_to(REPO)}:{number}: {doc} does not exist")
                elif anchor not in anchors(target):
                    bad.append(f"{path.relative_to(REPO)}:{number}: {doc} has no section #{anchor}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("heading, anchor", [
    ("One training batch", "one-training-batch"),
    ("Data-plane frames", "data-plane-frames"),
    ("2. docker compose", "2-docker-compose"),
    ("5. Measurements (this 2-core, 24 GiB machine, no GPU)", "5-measurements-this-2-core-24-gib-machine-no-gpu"),
    ("Install and train the synthetic example (one command)", "install-and-train-the-synthetic-example-one-command"),
])
def test_slug(heading, anchor):
    assert slug(heading) == anchor
