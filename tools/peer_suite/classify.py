"""Sort a peer test's failure: *by design* (a difference the test plan mandates, ``by_design.py``),
*private* (the test reads torch FSDP2's internals, which no other implementation has), *message* (the
same exception type as FSDP2's, with other text), *behaviour*."""

from __future__ import annotations

import ast
import functools
import re
from dataclasses import dataclass
from pathlib import Path

from .by_design import DOCS_ROW, by_design
from .by_design import KIND as BY_DESIGN_KIND

# torch FSDP2's internals a test may read: out of scope for any other implementation
INTERNALS = (
    "fully_shard.state(",
    "_get_fsdp_state",
    "_get_module_fsdp_state",
    "FSDPParamGroup",
    "FSDPParam(",
    "FSDPState",
    "_fsdp_param_group",
    "_fsdp_param",
    "_fsdp_state",
    "_fsdp_init",
    "_fsdp_collectives",
    "_get_managed_modules",
    "_get_managed_states",
    "_get_param_module_infos",
    "ParamModuleInfo",
    "_modules_to_run_forward",
    "_force_complete_incomplete_states",
    "_set_unshard_async_op",
    "foreach_all_gather",
    "foreach_reduce",
    "patch_all_gather",
    "patch_reduce_scatter",
    "patch_all_reduce",
    "patch_post_backward",
    "patch_register_post_backward_hook_backward",
    "patch_unshard",
    "patch_reshard",
    '__class__.__name__, "FSDP',  # the class name FSDP2 gives (ours: HSDP<cls>)
)
LABELS = {'__class__.__name__, "FSDP': "the class name FSDP<cls>", "fully_shard.state(": "fully_shard.state()"}
REGEX_MISMATCH = re.compile(r'^"(?P<regex>.*)" does not match "(?P<text>.*)"$', re.S)
RANK_EXITED = re.compile(r"(Thread|Process) \d+ exited with")  # torch's harnesses wrap a rank's error so
FRAME_LINE = re.compile(r'File "(?P<file>[^"]+)", line \d+')
RAISED_LINE = re.compile(r"^(?P<type>[A-Za-z_][\w.]*(?:Error|Exception|Exit|Timeout|Interrupt)): ?(?P<message>.*)$")


@dataclass(frozen=True)
class Failure:
    kind: str  # "by design", "private", "message", "behaviour"
    error_type: str
    message: str  # its first line
    internals: tuple[str, ...]  # what of FSDP2's internals the test reads
    design: str = ""  # for "by design": why, and the row of docs/api.md's difference table


def innermost_error(error_type: str, message: str, longrepr: str) -> tuple[str, str]:
    """The exception that really failed the test: a rank's, where torch's harnesses wrap it as
    ``RuntimeError: Thread N exited with exception`` or ``Process N exited with error code``."""
    if error_type == "RuntimeError" and RANK_EXITED.search(message):
        for line in reversed((message + "\n" + longrepr).splitlines()):
            found = RAISED_LINE.match(line.strip().removeprefix("E").strip())
            if found and not RANK_EXITED.search(found["message"]):
                return found["type"].rsplit(".", 1)[-1], found["message"]
    return error_type, message.splitlines()[0] if message else ""


@functools.cache
def _test_sources(path: str) -> dict[str, str]:
    """``Class::test`` -> the source of that test method (and of the class's helper methods it may call)."""
    tree = ast.parse(Path(path).read_text())
    text = Path(path).read_text()
    sources: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            helpers = "\n".join(
                ast.get_source_segment(text, item) or ""
                for item in node.body
                if isinstance(item, ast.FunctionDef) and not item.name.startswith("test")
            )
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name.startswith("test"):
                    sources[f"{node.name}::{item.name}"] = (ast.get_source_segment(text, item) or "") + "\n" + helpers
    return sources


def internals_read(test_file: str, nodeid: str) -> tuple[str, ...]:
    """FSDP2 internals the test ``nodeid`` (``file::Class::test[params]``) reads."""
    parts = nodeid.split("::")
    key = f"{parts[-2]}::{parts[-1].split('[')[0]}" if len(parts) >= 3 else ""
    source = _test_sources(test_file).get(key, "")
    return tuple(LABELS.get(name, name.rstrip("(")) for name in INTERNALS if name in source)


def _raised_inside(longrepr: str, implementation_paths: tuple[str, ...]) -> bool:
    """Whether the innermost frame of the (innermost) traceback is the implementation's."""
    frames = FRAME_LINE.findall(longrepr)
    return bool(frames) and any(path and path in frames[-1] for path in implementation_paths)


def classify(test_file: str, record: dict, implementation_paths: tuple[str, ...] = ()) -> Failure:
    """Sort one failed (or timed-out) test of an implementation other than torch FSDP2. A test that
    reads FSDP2's internals is private unless what failed it was raised inside the implementation
    (``implementation_paths``: its package folders, as the traceback names them)."""
    error_type, message = innermost_error(
        record.get("error_type", ""), record.get("message", ""), record.get("longrepr", "")
    )
    internals = internals_read(test_file, record["nodeid"])
    longrepr = record.get("longrepr", "")
    first = message.splitlines()[0] if message else ""
    raised_inside = _raised_inside(longrepr, implementation_paths)
    design = by_design(record["nodeid"], error_type, first) if record.get("outcome") == "failed" else None
    if design is not None:
        why = f"{design.reason} ({design.docs_row!r}, {DOCS_ROW})"
        return Failure(BY_DESIGN_KIND, error_type, first[:300], internals, why)
    if internals and not raised_inside and record.get("outcome") != "timeout":
        kind = "private"
    elif error_type == "AssertionError" and REGEX_MISMATCH.match(first):
        kind = "message"
    else:
        kind = "behaviour"
    return Failure(kind, error_type, first[:300], internals)
