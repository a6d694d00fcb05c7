"""Ranks hosted as threads of one process (torch's threaded process group, as torch's own FSDP2 tests
host them): each thread shards its own copy of a model and trains it; the grads must equal a single
device's on the global batch. Run as ``python -m tests.engine._threads_body``: prints one line per
rank and exits 0, or exits 1 naming what failed (a rank that does not finish in time is a failure)."""

from __future__ import annotations

import sys
import threading

import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg, _uninstall_threaded_pg

WORLD = 2
STEPS = 2
JOIN_SECONDS = 60


_SEEDING = threading.Lock()  # torch's default generator is one per process: threads take turns


def _model() -> nn.Sequential:
    with _SEEDING:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(3, 8, generator=torch.Generator().manual_seed(100 * step + rank))


def _reference_grads(step: int) -> list[torch.Tensor]:
    """A single device's grads on the global batch (the mean over ranks' batches)."""
    model = _model()
    batch = torch.cat([_batch(step, rank) for rank in range(WORLD)])
    model(batch).square().mean().backward()
    return [p.grad for p in model.parameters()]


def _rank(rank: int, store: dist.Store, errors: dict[int, float | str]) -> None:
    from hyper_parallel import fully_shard

    try:
        dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
        model = _model()
        fully_shard(model[0])
        fully_shard(model[2])
        fully_shard(model)
        worst = 0.0
        for step in range(STEPS):
            model.zero_grad()
            model(_batch(step, rank)).square().mean().backward()
            for param, expected in zip(model.parameters(), _reference_grads(step), strict=True):
                worst = max(worst, (param.grad.full_tensor() - expected).abs().max().item())
        errors[rank] = worst
    except Exception as exc:  # reported by the main thread
        errors[rank] = f"{type(exc).__name__}: {exc}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def main() -> int:
    torch.set_num_threads(1)
    torch._C._distributed_c10d._set_thread_isolation_mode(True)  # a process group per thread
    world = _install_threaded_pg()
    store = dist.HashStore()
    errors: dict[int, float | str] = {}
    threads = [threading.Thread(target=_rank, args=(r, store, errors), daemon=True) for r in range(WORLD)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOIN_SECONDS)
    stuck = [r for r, t in enumerate(threads) if t.is_alive()]
    if not stuck:
        _uninstall_threaded_pg()
    del world
    for rank in range(WORLD):
        outcome = f"did not finish in {JOIN_SECONDS} s" if rank in stuck else errors.get(rank)
        print(f"rank {rank}: {outcome}")
    bad = stuck or [r for r, e in errors.items() if not isinstance(e, float) or e > 1e-6]
    return 1 if bad or len(errors) < WORLD else 0


if __name__ == "__main__":
    sys.exit(main())
