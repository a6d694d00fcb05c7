"""What went wrong on which rank: the failure a run raises, and the texts it is built from
(remote tracebacks, faulthandler stacks made readable, how an engine process ended)."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import time
from pathlib import Path
from typing import Any

import psutil

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class RankFailure(AssertionError):
    """A distributed run failed: message names each failing rank with its traceback or Python stack.

    Besides the text, it says how each rank failed, so a verdict can tell an implementation
    that refused a feature (``raised``) from one that hung (``timed_out``) or died (``dead``).
    """

    failures: dict[int, str]  # rank -> traceback, Python stack or death notice
    elapsed_s: float | None  # seconds from the start of the run until the failure was seen

    def __init__(
        self,
        summary: str,
        failures: dict[int, str],
        elapsed_s: float | None = None,
        raised: dict[int, tuple[str, str]] | None = None,
        dead: set[int] | frozenset[int] = frozenset(),
        timed_out: bool = False,
        sites: dict[int, dict[str, Any]] | None = None,
    ) -> None:
        """Build the message from a one-line summary and rank -> text."""
        self.summary = summary
        self.failures = dict(sorted(failures.items()))
        self.elapsed_s = elapsed_s
        self.raised = dict(raised or {})  # rank -> (exception type name, first line of its message)
        self.dead = set(dead)
        self.timed_out = timed_out
        self.sites = dict(sites or {})  # rank -> where its traced run was when it was found stuck
        parts = [summary]
        for rank, text in self.failures.items():
            parts.append(f"\n===== rank {rank} =====\n{text.rstrip()}")
        super().__init__("\n".join(parts))

    def __reduce__(self) -> tuple:
        """Pickle support (pytest-xdist, ipyparallel) despite the multi-argument constructor."""
        args = (self.summary, self.failures, self.elapsed_s, self.raised, self.dead, self.timed_out)
        return (type(self), args)


def format_remote_error(exc: BaseException) -> str:
    """Traceback text of an ipyparallel RemoteError (ANSI colours removed)."""
    tb = getattr(exc, "traceback", None)
    if tb:
        text = tb if isinstance(tb, str) else "\n".join(tb)
    else:
        text = f"{type(exc).__name__}: {exc}"
    return _ANSI.sub("", text)


def error_parts(exc: BaseException) -> tuple[str, str]:
    """(exception type name, first line of its message) of a remote (or local) exception."""
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None)
    if evalue is None:
        evalue = str(exc)
    first = str(evalue).strip().splitlines()
    return ename, first[0] if first else ""


def error_line(exc: BaseException) -> str:
    """'EName: evalue' of a remote (or local) exception."""
    ename, evalue = error_parts(exc)
    return f"{ename}: {evalue}"


def strip_ansi(text: str) -> str:
    """Text without terminal colour codes."""
    return _ANSI.sub("", text)


_IDLE_FRAME = re.compile(
    r'File "[^"]*(?:/threading\.py|/selectors\.py|/queue\.py'
    r'|/(?:asyncio|concurrent|tornado|zmq|ipykernel|ipyparallel)/[^"]*)"|in _watch_parent$'
)


def format_stack(raw: str, main_thread: int | None) -> str:
    """faulthandler dump made readable: main thread first and cut at the rank entry, idle threads dropped."""
    lines = [line for line in raw.strip().splitlines() if not line.startswith("Extension modules:")]
    if not lines:
        return ""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x)", "\n".join(lines))
    tag = f"0x{main_thread:016x}" if main_thread else None
    preface, main, others, idle = [], [], [], 0
    for block in blocks:
        header, _, body = block.strip().partition("\n")
        if not header.startswith(("Thread 0x", "Current thread 0x")):
            preface.append(block.strip())  # e.g. "Fatal Python error: Segmentation fault"
        elif tag and tag in header:
            frames = body.splitlines()
            cut = [i for i, f in enumerate(frames) if f.endswith(" in rank_entry")]
            if cut:  # frames below the rank entry are ipyparallel's request dispatch
                frames = frames[: cut[0] + 1] + ["  ... (ipyparallel engine frames)"]
            header = header.replace("(most recent call first)", "(main thread, most recent call first)")
            main.append("\n".join([header, *frames]))
        elif body and all(_IDLE_FRAME.search(f) for f in body.splitlines() if f.strip()):
            idle += 1
        else:
            others.append(block.strip())
    text = "\n\n".join(preface + main + others)
    if idle:
        text += f"\n\n({idle} idle ipyparallel/zmq/asyncio threads not shown)"
    return text


def completed_at(ar: Any) -> float:
    """Engine-side completion time of a finished task (inf if unknown): first failure first."""
    with contextlib.suppress(Exception):
        stamp = ar.metadata["completed"]
        if isinstance(stamp, list):
            stamp = stamp[0]
        return stamp.timestamp()
    return float("inf")


def tail(path: str, lines: int = 12) -> str:
    """Last lines of a text file ('' if missing)."""
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def exit_text(proc: psutil.Process | None, status_file: str = "") -> str:
    """' (exit code N)' / ' (killed by SIGX)' for a dead child, or a dead process whose exit code
    its parent wrote to ``status_file`` (a forked engine's zygote); '' when unknown."""
    code = _child_exit_code(proc)
    if code is None and status_file:
        code = _recorded_exit_code(status_file)
    if code is None:
        return ""
    if code < 0:
        try:
            return f" (killed by {signal.Signals(-code).name})"
        except ValueError:
            return f" (killed by signal {-code})"
    return f" (exit code {code})"


def _child_exit_code(proc: psutil.Process | None) -> int | None:
    """Exit code of a dead child process (None: still running, not ours, or unknown)."""
    if proc is None:
        return None
    try:
        return proc.wait(timeout=0)
    except (psutil.Error, ChildProcessError, OSError):
        return None


def _recorded_exit_code(path: str, within: float = 1.0) -> int | None:
    """The exit code written to ``path``, waiting up to ``within`` seconds for its writer."""
    end = time.monotonic() + within
    while True:
        with contextlib.suppress(OSError, ValueError):
            return int(Path(path).read_text())
        if time.monotonic() > end:
            return None
        time.sleep(0.02)


def task_output(ar: Any) -> str:
    """Captured stdout/stderr of one rank's task (tail), if any."""
    out = []
    for name in ("stdout", "stderr"):
        with contextlib.suppress(Exception):
            text = getattr(ar, name)
            if isinstance(text, list):
                text = text[0] if text else ""
            if text:
                out.append(f"\n[{name}]\n" + _ANSI.sub("", text[-4000:]))
    return "".join(out)


SITE_BYTES = 1024  # a published site's record, padded: each write covers the last whole
_SITE_SLACK_S = 1.0  # a record's start may read a little before the run's start as the driver measured it


def site_file(stack_path: str) -> str:
    """Where a rank's engine publishes its traced run's site (``tests.kit.judging.crash.Site``), beside
    its faulthandler stacks."""
    return stack_path + ".site"


def read_site(stack_path: str, since: float) -> dict[str, Any] | None:
    """The site a rank's traced run last published, if that run started at ``since`` (wall clock) or
    later: a run that ended normally leaves no file, one that raised leaves its last place, and an
    older run's record says nothing of this one (None)."""
    try:
        with open(site_file(stack_path), "rb") as published:
            text = published.read().decode(errors="replace").strip()
        record = json.JSONDecoder().raw_decode(text)[0] if text else None
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.pop("since", 0.0) < since - _SITE_SLACK_S:
        return None
    return record


def site_text(site: dict[str, Any]) -> str:
    """A published site as the failure's text says it: step, phase, module and tensor."""
    return f"{site['step']}, {site['phase']}, {site['module'] or '(root)'} {site['tensor']}".rstrip()
