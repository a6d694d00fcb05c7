"""The documentation names only things that exist, and the case catalogue matches the registry.

Checked in ``docs/*.md`` and ``README.md``:

- inline code spans: every token that looks like a repository path (it contains a ``/`` or ends
  in a known extension) must exist. A token with a ``/`` is taken relative to the repository
  root; a bare file name (``toy_fsdp.py``) must be the name of a file somewhere in the
  repository, or a file name the code itself writes (a quoted string in a Python source, such as
  ``"results.json"``). Dotted names of the repository's modules (``tests.kit.judging.case.case_by_id``)
  must resolve to a module and the names after it must occur in its source. ``native:PATH`` and
  ``file:PATH`` specs are checked as paths;
- fenced code blocks: the same, for tokens with a ``/`` and module names only (commands there
  name output files such as ``out.ipynb`` that do not exist);
- links and images: relative to the file that holds them (what a Markdown viewer does), and a
  ``#fragment`` must be a heading of the target page.

README.md is the front page: it links every ``docs/*.md`` page (outside code) and has at most
``README_MAX_LINES`` lines; the rest of what a reader needs lives on those pages.

Not checked: URLs, absolute paths (``/path/to/hyper-parallel``), anything under ``runs/`` (the
sweep's output), and tokens with placeholder or wildcard characters (``<ts>``, ``{level}``,
``*``, ``=``). No cluster is started: the catalogue is compared by importing the plan files.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import xml.dom.minidom
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
DOC_FILES = [*sorted(DOCS.glob("*.md")), README]
README_MAX_LINES = 130
EXTENSIONS = (".py", ".md", ".ipynb", ".svg", ".json", ".cfg", ".toml", ".yml", ".yaml", ".txt", ".html", ".log")
NOT_IN_REPO = {".git", "runs", "build", "__pycache__", ".pytest_cache", ".ruff_cache", ".ipynb_checkpoints"}
PLACEHOLDER = re.compile(r"[<>{}*?$|=\[\]~]")
PATH_TOKEN = re.compile(r"^[\w.\-]+(?:/[\w.\-]*)*$")
SPEC_TOKEN = re.compile(r"^(?:native|file):(.+)$")
MODULE_TOKEN = re.compile(r"^(?:hyper_parallel|tests|tools|benchmarks)(?:\.[A-Za-z_]\w*)+(?:\(\))?$")
FENCE = re.compile(r"^\s*(```|~~~)")
CODE_SPAN = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$")


def _in_repo_walk() -> list[Path]:
    files = []
    for folder, dirs, names in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in NOT_IN_REPO and not d.endswith(".egg-info")]
        files.extend(Path(folder) / name for name in names)
    return files


@functools.cache
def repo_file_names() -> frozenset[str]:
    """The name of every file in the repository (outside caches and outputs)."""
    return frozenset(path.name for path in _in_repo_walk())


@functools.cache
def written_names() -> frozenset[str]:
    """File names quoted in Python sources: files the code writes (``"results.json"``)."""
    names: set[str] = set()
    for path in _in_repo_walk():
        if path.suffix == ".py" and path != Path(__file__).resolve():  # not this file's examples
            names.update(re.findall(r"[\"']([\w.\-]+\.\w+)[\"']", path.read_text(errors="replace")))
    return frozenset(names)


def _outside_repo(path: Path) -> bool:
    try:
        parts = path.resolve().relative_to(ROOT).parts
    except ValueError:
        return True
    return bool(parts) and (parts[0] in NOT_IN_REPO or parts[0].endswith(".egg-info"))


def module_problem(name: str) -> str | None:
    """Why a dotted name of the repository does not resolve (None when it does)."""
    parts = name.removesuffix("()").split(".")
    where, used = ROOT, 0
    while used < len(parts):
        package, module = where / parts[used], where / f"{parts[used]}.py"
        if package.is_dir():
            where, used = package, used + 1
        elif module.is_file():
            where, used = module, used + 1
            break
        else:
            break
    source_file = where / "__init__.py" if where.is_dir() else where
    rest = parts[used:]
    if not rest:
        return None
    source = source_file.read_text() if source_file.is_file() else ""
    missing = [part for part in rest if not re.search(rf"\b{re.escape(part)}\b", source)]
    if missing or not source:
        return f"{'.'.join(parts[:used])} has no {'.'.join(rest)}"
    return None


# git-ignored folders the project's commands write (the sweep's runs/, make test-torch's venvs): named
# in the docs, absent from a fresh clone
WRITTEN_FOLDERS = ("runs", ".venvs")


def token_problem(token: str, fenced: bool) -> str | None:
    """Why a token of a code span or block names nothing in the repository (None: fine or not a path)."""
    token = token.strip("\"'`,;:()").rstrip(".")
    if not token or "://" in token:
        return None
    spec = SPEC_TOKEN.match(token)
    if spec:
        token = spec.group(1)
    if PLACEHOLDER.search(token):
        return None
    if MODULE_TOKEN.match(token):
        return module_problem(token)
    if token.startswith("/") or not PATH_TOKEN.match(token) or token.split("/")[0] in WRITTEN_FOLDERS:
        return None
    if "/" in token:
        path = ROOT / token
        if not re.search(r"\w", token):
            return None
        if not path.exists() or _outside_repo(path):
            return "no such path in the repository"
        return None
    if fenced or not token.endswith(EXTENSIONS) or token in EXTENSIONS:  # `.py` names an extension
        return None
    if token in repo_file_names() or token in written_names():
        return None
    return "no file of that name in the repository, and no file the code writes"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def split_fences(text: str) -> tuple[str, list[tuple[int, str]]]:
    """(the text with fenced blocks blanked, keeping line numbers; (line, text) of fenced lines)."""
    prose, fenced, inside = [], [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            prose.append("")
        elif inside:
            fenced.append((number, line))
            prose.append("")
        else:
            prose.append(line)
    return "\n".join(prose), fenced


def anchors(text: str) -> set[str]:
    """Anchors of every heading outside fenced blocks, duplicates numbered as GitHub does."""
    prose, _ = split_fences(text)
    seen: dict[str, int] = {}
    found = set()
    for line in prose.splitlines():
        match = HEADING.match(line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def link_problem(target: str, doc: Path) -> str | None:
    """Why a link or image target of ``doc`` leads nowhere (None when it is fine or external)."""
    if re.match(r"^[a-z][a-z0-9+.\-]*:", target, re.I):  # http:, https:, mailto:, ...
        return None
    path_part, _, fragment = target.partition("#")
    path = (doc.parent / path_part).resolve() if path_part else doc
    if path_part and (PLACEHOLDER.search(path_part) or path_part.startswith("/")):
        return None
    if not path.exists() or _outside_repo(path):
        return "no such path in the repository"
    if fragment and path.suffix == ".md" and fragment not in anchors(path.read_text()):
        return f"{path.relative_to(ROOT).as_posix()} has no heading #{fragment}"
    return None


def _blank_code_spans(prose: str) -> str:
    """``prose`` with every code span blanked, keeping line numbers and offsets."""
    return CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), prose)


def linked_files(text: str, doc: Path) -> set[Path]:
    """The files the links of ``doc`` (whose contents are ``text``) lead to, outside code."""
    prose, _ = split_fences(text)
    targets = (match.group(1).partition("#")[0] for match in LINK.finditer(_blank_code_spans(prose)))
    return {(doc.parent / target).resolve() for target in targets if target and "://" not in target}


def unlinked_pages(readme_text: str) -> list[str]:
    """The ``docs/*.md`` pages the front page (``readme_text``, as README.md) does not link."""
    linked = linked_files(readme_text, README)
    return [page.name for page in sorted(DOCS.glob("*.md")) if page.resolve() not in linked]


def problems(text: str, doc: Path) -> list[str]:
    """Every name in ``text`` (the contents of ``doc``) that points at nothing."""
    where = doc.relative_to(ROOT).as_posix() if doc.is_relative_to(ROOT) else doc.name
    found = []
    prose, fenced = split_fences(text)
    for match in CODE_SPAN.finditer(prose):
        if "\n\n" in match.group(2):
            continue  # not a code span: a lone backtick paired across paragraphs
        line = prose.count("\n", 0, match.start()) + 1
        for token in match.group(2).split():
            why = token_problem(token, fenced=False)
            if why:
                found.append(f"{where}:{line}: `{token}`: {why}")
    for line, content in fenced:
        for token in content.split():
            why = token_problem(token, fenced=True)
            if why:
                found.append(f"{where}:{line}: {token} (code block): {why}")
    outside_code = _blank_code_spans(prose)
    for match in LINK.finditer(outside_code):
        why = link_problem(match.group(1), doc)
        if why:
            line = outside_code.count("\n", 0, match.start()) + 1
            found.append(f"{where}:{line}: link {match.group(1)}: {why}")
    return found


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_named_path_exists(doc: Path) -> None:
    """Each path, module name and link of the page exists in the repository."""
    found = problems(doc.read_text(), doc)
    assert not found, "names that point at nothing:\n" + "\n".join(found)


def test_the_front_page_links_every_docs_page() -> None:
    """README.md links each page of docs/, so a reader who starts there can reach all of them."""
    missing = unlinked_pages(README.read_text())
    assert not missing, f"README.md links no {', '.join(missing)}: add a line for each under 'Where to read more'"


def test_the_front_page_is_short() -> None:
    """README.md stays a front page: details go to a docs/ page it links."""
    count = len(README.read_text().splitlines())
    assert count <= README_MAX_LINES, (
        f"README.md has {count} lines (at most {README_MAX_LINES}): move details to a page under docs/"
    )


def test_an_unlinked_page_is_caught() -> None:
    """A page linked only inside code, or by a wrong name, counts as unlinked; a #fragment still links."""
    first, *rest = sorted(DOCS.glob("*.md"))
    text = "\n".join(f"- [{page.stem}](docs/{page.name}#a-heading)" for page in rest)
    text += f"\n`[{first.stem}](docs/{first.name})` and [{first.stem}](docs/{first.stem}.txt)\n"
    text += f"```\n[{first.stem}](docs/{first.name})\n```\n"
    assert unlinked_pages(text) == [first.name]
    assert unlinked_pages(text + f"[{first.stem}](docs/{first.name})\n") == []


def test_the_docs_are_there() -> None:
    """The architecture page, its picture (well-formed SVG, referenced) and the catalogue."""
    architecture = (DOCS / "architecture.md").read_text()
    assert "](case_flow.svg)" in architecture
    svg = xml.dom.minidom.parse(str(DOCS / "case_flow.svg")).documentElement
    assert svg.tagName == "svg"
    assert (DOCS / "cases.md").is_file()


def test_a_wrong_name_is_caught() -> None:
    """The extraction is strict: each typo below is reported, and nothing that is fine."""
    wrong = {
        "`tests/kit/casse.py`": "tests/kit/casse.py",
        "`_watchdgo.py`": "_watchdgo.py",
        "`python benchmarks/bench_fsdp.py --help`": "benchmarks/bench_fsdp.py",
        "`tests.kit.judging.case.load_plan_casez()`": "load_plan_casez",
        "`tests.kit.caes`": "tests.kit.caes",
        "`native:tests/fakes/raisin`": "native:tests/fakes/raisin",
        "[the kit](../tests/kitt/)": "../tests/kitt/",
        "[cases](cases.md#no-such-heading)": "no-such-heading",
        "```\npython -m tests.kit.sweeep\n```": "tests.kit.sweeep",
    }
    fine = (
        "`tests/kit/judging/case.py` `_watchdog.py` `results.json` `tests.kit.judging.case.load_plan_cases()` "
        "`native:tests/fakes/raising` `runs/<timestamp>/index.html` `runs/20250101-120000` "
        "`/path/to/hyper-parallel` `https://example.org/a.py` `{level}.ipynb` `tests/**/_ranks_*.py` "
        "`Shard(d) / Replicate() / None` `cores // world_size` [picture](case_flow.svg) "
        "[how](architecture.md#how-one-case-runs) [readme](../README.md)\n"
        "```\npapermill notebooks/L1_interface.ipynb out.ipynb -p cases L1-03\n```\n"
    )
    doc = DOCS / "example.md"  # links resolve from docs/; the file itself is never written
    assert problems(fine, doc) == []
    for text, name in wrong.items():
        found = problems(fine + text + "\n", doc)
        assert len(found) == 1 and name in found[0], (text, found)


def _catalogue() -> ModuleType:
    spec = importlib.util.spec_from_file_location("docs_catalogue", DOCS / "catalogue.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_case_catalogue_is_current() -> None:
    """docs/cases.md is exactly what docs/catalogue.py writes from the registry."""
    catalogue = _catalogue()
    text = catalogue.CASES_MD.read_text()
    assert catalogue.splice(text, catalogue.generated()) == text, "docs/cases.md is stale: run python docs/catalogue.py"


def test_plan_fidelity_table_is_current() -> None:
    """docs/plan_fidelity.md is exactly what docs/catalogue.py writes from tests/kit/plan/."""
    catalogue = _catalogue()
    assert catalogue.FIDELITY_MD.read_text() == catalogue.fidelity(), (
        "docs/plan_fidelity.md is stale: run python docs/catalogue.py"
    )
