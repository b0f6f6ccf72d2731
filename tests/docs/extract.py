"""The shell commands of the documentation: every line of a ```bash block in README.md, docs/*.md and the files
those pages include with pymdownx.snippets (`--8<-- "path"` or `--8<-- "path:section"`), continuation lines joined,
comments dropped, an empty word written "", `a && b` split into `a` and `b`, and a here-document's body (after
`<<'END'` up to `END`) taken as part of the command that opens it. A command is keyed by its words joined with single spaces, as
tests/docs/commands.py writes it."""
import re
import shlex
from pathlib import Path
from typing import Iterator, List, Tuple

REPO = Path(__file__).resolve().parents[2]
SHELL_LANGUAGES = ("bash", "sh", "shell", "console")
INCLUDE = re.compile(r'^\s*--8<--\s+"([^":]+)(?::[^"]*)?"\s*$', re.M)
FENCE = re.compile(r"^(\s*)```(\S*)\s*$")
HEREDOC = re.compile(r"<<-?\s*(['\"]?)(\w+)\1")


def documentation_files() -> List[Path]:
    """README.md, docs/*.md, and every file a docs page includes (whole files: a section's file is read whole)."""
    pages = sorted((REPO / "docs").glob("*.md"))
    included = {REPO / path for page in pages for path in INCLUDE.findall(page.read_text(encoding="utf-8"))}
    return [REPO / "README.md", *pages, *sorted(included - set(pages) - {REPO / "README.md"})]


def fenced_blocks(text: str) -> Iterator[Tuple[int, str, str]]:
    """(line number of the opening fence, its language, the block's text) for each fenced code block."""
    lines = text.splitlines()
    start, language, body = None, "", []
    for number, line in enumerate(lines, start=1):
        fence = FENCE.match(line)
        if fence and start is None:
            start, language, body = number, fence.group(2), []
        elif fence and start is not None:
            yield start, language, "\n".join(body)
            start = None
        elif start is not None:
            body.append(line)


def block_commands(block: str) -> List[str]:
    """The commands of one shell block, each as its words joined by single spaces."""
    commands: List[str] = []
    here_document_end = None
    for line in block.replace("\\\n", " ").splitlines():
        if here_document_end is not None:
            if line.strip() == here_document_end:
                here_document_end = None
            continue
        opens = HEREDOC.search(line)
        if opens:
            here_document_end = opens.group(2)
        words = shlex.split(line, comments=True)
        current: List[str] = []
        for word in words + ["&&"]:
            if word == "&&":
                if current:
                    commands.append(" ".join(current))
                current = []
            else:
                current.append(word or '""')
    return commands


def documented_commands() -> List[Tuple[str, str]]:
    """(command, where: 'path:line') for every command of every shell block of the documentation, in order."""
    found = []
    for path in documentation_files():
        for line, language, block in fenced_blocks(path.read_text(encoding="utf-8")):
            if language in SHELL_LANGUAGES:
                found += [(command, f"{path.relative_to(REPO)}:{line}") for command in block_commands(block)]
    return found


def untagged_blocks() -> List[str]:
    """'path:line' of each fenced block without a language: a command there would escape the check."""
    return [f"{path.relative_to(REPO)}:{line}" for path in documentation_files()
            for line, language, _ in fenced_blocks(path.read_text(encoding="utf-8")) if not language]
