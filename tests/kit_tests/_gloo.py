"""What a one-rank gloo world of the installed torch does with ``ReduceOp.AVG``, asked through the
public API in a process of its own: the answer the probes of the engine and the kit must give."""

from __future__ import annotations

import functools
import subprocess
import sys

_PUBLIC_AVG = """
import torch, torch.distributed as dist
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
try:
    dist.all_reduce(torch.ones(1), op=dist.ReduceOp.AVG)
    print("averages")
except RuntimeError as exc:
    print("refused" if "AVG" in str(exc) else exc)
"""


@functools.cache  # one process per pytest session: the engine's test and the kit's ask alike
def public_gloo_avg() -> str:
    """The answer: "averages" or "refused"."""
    done = subprocess.run([sys.executable, "-c", _PUBLIC_AVG], capture_output=True, text=True, timeout=120)
    answer = done.stdout.strip().splitlines()[-1:] or [done.stderr]
    assert answer[0] in ("averages", "refused"), done.stdout + done.stderr
    return answer[0]


class RefusingGloo:
    """A gloo process group as torch 2.6 and 2.7 have it: all-reduce refuses ``ReduceOp.AVG``."""

    def __init__(self, *args: object) -> None:
        pass

    def allreduce(self, tensors: list, options: object) -> None:
        raise RuntimeError("Cannot use ReduceOp.AVG with Gloo")
