"""Two DCP checkpoints compared entry by entry, bitwise (``python checkpoints.py A B`` prints JSON).

Run in the trainers' venv: a torchtitan checkpoint's non-tensor entries (its data loader's state)
may be torchtitan's objects, which only unpickle where torchtitan is installed.
"""

from __future__ import annotations

import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Any


def flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    """A nested state dict as ``{"a.b.c": leaf}`` (dicts and lists descended into)."""
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    entries: dict[str, Any] = {}
    for key, value in items:
        entries.update(flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return entries


def same(a: Any, b: Any) -> bool:
    """Whether two leaves are equal: tensors bit for bit (dtype, shape and bytes), others by value."""
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return False
        if a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(_bytes(a), _bytes(b))
    if isinstance(a, io.BytesIO) and isinstance(b, io.BytesIO):
        return a.getvalue() == b.getvalue()
    return a == b


def _bytes(tensor: Any) -> Any:
    """A tensor's storage as bytes, so -0.0, 0.0 and NaN payloads count as different."""
    import torch

    return tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8)


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """The entries of two flat checkpoints that differ: present in one only, or not ``same``."""
    found = [f"only in the first: {key}" for key in sorted(a.keys() - b.keys())]
    found += [f"only in the second: {key}" for key in sorted(b.keys() - a.keys())]
    found += [f"differs: {key}" for key in sorted(a.keys() & b.keys()) if not same(a[key], b[key])]
    return found


def load(folder: Path) -> dict[str, Any]:
    """A DCP checkpoint folder's entries, flat, on the CPU, without a process group."""
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as scratch:
        path = Path(scratch) / "state.pt"
        dcp_to_torch_save(str(folder), str(path))
        return flat(torch.load(path, weights_only=False))


def main(first: str, second: str) -> None:
    a, b = load(Path(first)), load(Path(second))
    print(json.dumps({"entries": len(a), "differences": differences(a, b)}))


if __name__ == "__main__":
    main(*sys.argv[1:3])
