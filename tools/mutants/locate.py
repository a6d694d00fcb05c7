"""Where a mutant's edit goes: its code found by its tokens, in whichever engine file holds it now.

A mutant names the code it changes by that code's text (``find``), but the text is matched as Python
tokens, not characters: indentation, line breaks inside brackets, blank lines and comments do not
count. So a refactor that moves the code to another file or class, renames the function around it,
reflows a call or re-indents a block carries the mutant along; only a change of the tokens it
mutates (the behaviour) makes it stale. The match must be unique across the engine's files.
"""

from __future__ import annotations

import ast
import functools
import io
import re
import textwrap
import tokenize
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

ENGINE_ROOT = "hyper_parallel"
# tokens that carry no behaviour: layout (line ends too: a fragment's last line end reads as a
# statement's end, the same line inside brackets does not) and comments
_LAYOUT = {
    tokenize.NL,
    tokenize.NEWLINE,
    tokenize.COMMENT,
    tokenize.INDENT,
    tokenize.DEDENT,
    tokenize.ENCODING,
    tokenize.ENDMARKER,
}


_LINE_END = re.compile(r"[ \t]*(#[^\n]*)?\n")


@dataclass(frozen=True)
class Token:
    kind: int
    text: str
    start: int  # character offsets in the text tokenized
    end: int

    @property
    def key(self) -> tuple[int, str]:
        """What must be equal for two tokens to match."""
        return (self.kind, self.text)


@dataclass(frozen=True)
class Location:
    """Where one mutant's code is: the file (relative to the root), its character span, and the
    qualified name of the function or class around it."""

    file: str
    start: int
    end: int
    qualname: str


def tokens(text: str) -> list[Token]:
    """The behaviour-carrying tokens of ``text`` (a whole file, or a fragment of one: its common
    indentation is removed first, and a fragment ending inside brackets keeps the tokens before)."""
    dedented = textwrap.dedent(text)
    shift = _dedent_shifts(text, dedented)
    starts = _line_starts(text)
    found: list[Token] = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(dedented).readline):
            if tok.type in _LAYOUT:
                continue
            (r0, c0), (r1, c1) = tok.start, tok.end
            start = starts[r0 - 1] + c0 + shift[r0 - 1]
            end = starts[r1 - 1] + c1 + shift[r1 - 1]
            found.append(Token(tok.type, tok.string, start, end))
    except (tokenize.TokenError, IndentationError):
        pass  # a fragment ending mid-statement: the tokens read so far
    return found


def _line_starts(text: str) -> list[int]:
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return starts


def _dedent_shifts(text: str, dedented: str) -> list[int]:
    """Per line, how many characters ``textwrap.dedent`` removed from its start."""
    shifts = [len(a) - len(b) for a, b in zip(text.splitlines(True), dedented.splitlines(True), strict=True)]
    return shifts + [0]


@functools.lru_cache(maxsize=128)
def _file_tokens(text: str) -> tuple[tuple[Token, ...], tuple[tuple[int, str], ...]]:
    """A whole file's tokens and their keys, kept: every mutant searches the same engine files."""
    found = tuple(tokens(text))
    return found, tuple(t.key for t in found)


def _spans(needle: list[Token], keys: tuple[tuple[int, str], ...]) -> list[tuple[int, int]]:
    """Every place ``needle``'s tokens occur in a row among a file's token ``keys``: (first, last) indices."""
    want = tuple(t.key for t in needle)
    first = want[0]
    return [
        (i, i + len(want) - 1)
        for i in range(len(keys) - len(want) + 1)
        if keys[i] == first and tuple(keys[i : i + len(want)]) == want
    ]


def locate(find: str, sources: Mapping[str, str], label: str = "a mutant") -> Location:
    """The one place ``find``'s tokens occur among ``sources`` (file -> text); ``LookupError`` if
    none or several (``label`` names the mutant in the message)."""
    needle = tokens(find)
    hits = [
        (file, span, toks)
        for file, text in sources.items()
        for toks, keys in [_file_tokens(text)]
        for span in (_spans(needle, keys) if needle else [])
    ]
    if len(hits) != 1:
        where = ", ".join(sorted({file for file, _, _ in hits})) or "no engine file"
        raise LookupError(f"{label}: its code occurs {len(hits)} times ({where}), must be once")
    file, (first, last), toks = hits[0]
    text = sources[file]
    start, end = _whole_lines(find, needle, text, toks[first].start, toks[last].end)
    return Location(file, start, end, qualname_at(text, text.count("\n", 0, toks[first].start) + 1))


def _whole_lines(find: str, needle: list[Token], text: str, start: int, end: int) -> tuple[int, int]:
    """The span to replace: from the line's start when ``find`` starts with its indentation, to
    past the line's end when ``find`` ends with one."""
    if not find[: needle[0].start].strip(" \t") and not find[: needle[0].start].count("\n"):
        line_start = text.rfind("\n", 0, start) + 1
        if not text[line_start:start].strip(" \t"):
            start = line_start
    if _LINE_END.match(find, needle[-1].end):  # the rest of the line (a comment too) goes with it
        newline = text.find("\n", end)
        end = len(text) if newline < 0 else newline + 1
    return start, end


def rewrite(find: str, replace: str, text: str, location: Location) -> str:
    """``text`` with the located code replaced by ``replace``, re-indented to where the code is now."""
    delta = _column(text, _first_code(text, location.start)) - _column(find, _first_code(find, 0))
    return text[: location.start] + _shift(replace, delta) + text[location.end :]


def _first_code(text: str, start: int) -> int:
    match = re.compile(r"[^ \t\n]").search(text, start)
    return match.start() if match else start


def _column(text: str, offset: int) -> int:
    return offset - (text.rfind("\n", 0, offset) + 1)


def _shift(text: str, delta: int) -> str:
    """Every line of ``text`` indented ``delta`` columns more (or less, as far as its spaces go)."""
    if delta == 0:
        return text
    lines = text.splitlines(keepends=True)
    if delta > 0:
        return "".join(" " * delta + line if line.strip() else line for line in lines)
    return "".join(line[min(-delta, len(line) - len(line.lstrip(" "))) :] for line in lines)


def qualname_at(text: str, line: int) -> str:
    """The dotted name of the innermost function or class holding ``line`` ("" at module level)."""
    names: list[str] = []

    def visit(node: ast.AST, prefix: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if child.lineno <= line <= (child.end_lineno or child.lineno):
                    names[:] = [*prefix, child.name]
                    visit(child, [*prefix, child.name])
            else:
                visit(child, prefix)

    tree = _parsed(text)
    if tree is None:
        return ""
    visit(tree, [])
    return ".".join(names)


@functools.lru_cache(maxsize=128)
def _parsed(text: str) -> ast.Module | None:
    """A file's syntax tree, kept (None where it does not parse)."""
    try:
        return ast.parse(text)
    except SyntaxError:
        return None


def engine_sources(root: Path, files: Iterable[str] | None = None) -> dict[str, str]:
    """The engine's Python files under ``root`` (relative path -> text), or just ``files``."""
    paths = [root / f for f in files] if files is not None else sorted((root / ENGINE_ROOT).rglob("*.py"))
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8") for p in paths if p.is_file()}
