"""Rank functions for tests/kit_tests/test_cluster.py (they run on the engines, imported by name)."""

from __future__ import annotations

import ctypes
import os
import signal
import time

import torch
import torch.distributed as dist

from tests.kit.runtime.rank_runtime import keep


def allreduce_sum() -> dict:
    """Each rank contributes rank + 1; returns the all_reduce sum and what the rank saw."""
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world_size": dist.get_world_size(),
        "sum": t.item(),
        "threads": torch.get_num_threads(),
        "backend": dist.get_backend(),
    }


def trivial() -> int:
    """Cheapest possible rank function: the rank (for the warm-overhead measurement)."""
    return dist.get_rank()


def seeded_draw() -> float:
    """A random number drawn right after the per-rank torch.manual_seed(0)."""
    return torch.rand(1).item()


def keep_objects(tag: str) -> str:
    """Store an object in the engine namespace via keep(); return the tag."""
    keep(kept_tensor=torch.full((2,), float(dist.get_rank())), kept_tag=tag)
    return tag


def fail_on_rank(bad_rank: int = 1) -> float:
    """bad_rank raises ValueError at once; the other ranks wait in an all_reduce for it."""
    if dist.get_rank() == bad_rank:
        raise ValueError(f"boom from rank {bad_rank}")
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def fail_at_once() -> None:
    """Every rank raises as soon as it has joined (how an implementation refuses a feature)."""
    raise ValueError(f"refused on rank {dist.get_rank()}")


def sleep_forever() -> None:
    """Never returns (a Python-level hang: answers SIGINT)."""
    while True:
        time.sleep(0.05)


def hang_in_collective() -> None:
    """Rank 0 waits in an all_reduce that rank 1 never joins (rank 1 sleeps forever)."""
    if dist.get_rank() == 1:
        sleep_forever()
    t = torch.ones(1)
    dist.all_reduce(t)


def deadlock_in_recv() -> None:
    """Both ranks wait in a gloo recv from each other: stuck in C, deaf to SIGINT."""
    t = torch.zeros(1)
    dist.recv(t, src=1 - dist.get_rank())


def deaf_to_sigint() -> None:
    """Ignore SIGINT, then sleep forever (stands for C code that never returns to Python)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sleep_forever()


def die_on_rank(how: str, bad_rank: int = 1) -> float:
    """bad_rank dies (how: 'exit' -> os._exit(3), 'sigkill', 'segfault'); the others all_reduce."""
    if dist.get_rank() == bad_rank:
        if how == "exit":
            os._exit(3)
        elif how == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif how == "segfault":
            ctypes.string_at(0)
        time.sleep(60)
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def last_run() -> dict:
    """This engine's record of its last run (rank, backend, device, host-local index, ...)."""
    from tests.kit.runtime.rank_runtime import _user_ns

    return _user_ns()["_last_run"]
