"""Benchmark ``hyper_parallel.fully_shard`` against torch FSDP2 on the same model, mesh and data.

Run (2 CPU ranks, gloo)::

    python -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/bench_fsdp2.py \
        [--steps 20 --warmup 3 --layers 4 --hidden 512 --batch 4 --seq 64] [--json out.json] [--profile 3]

or simply ``python benchmarks/bench_fsdp2.py [...]``, which re-executes itself under torchrun
with ``--nproc-per-node 2`` (``BENCH_NPROC`` overrides the count).

Both engines train a fresh deep copy of one seeded tiny decoder, wrapped bottom-up (each block,
then the root) on the same 1-D mesh with default ``reshard_after_forward`` (the root keeps its
params after forward), with AdamW, on the same per-rank token batches. The two trainings are
interleaved step by step (which engine goes first alternates), so machine noise hits both alike.
The default batch (4 sequences per rank) keeps a step near half a second on 2 CPU cores and the
whole run well under a minute. Printed per engine:

* step time: median over ``--steps`` measured steps after ``--warmup`` steps (zero_grad,
  forward, backward, optimizer step), per rank; the table shows the max over ranks of the
  per-rank medians, and beside it the min step time and the median process CPU time per step
  (``time.process_time``, all threads of the rank: insensitive to other processes taking the
  cores, which wall time on a shared machine is not).
* peak memory per rank (max over ranks), three labelled measures:
  - ``peak tensor bytes``: torch.cuda.max_memory_allocated on CUDA; on CPU the peak of live
    tensor storage bytes during one extra (untimed) step, tracked by
    ``torch.distributed._tools.mem_tracker.MemTracker`` (a TorchDispatchMode that sees every
    storage created, freed or resized, plus the model's params and the optimizer's state);
  - ``saved-for-backward peak``: peak bytes of the distinct storages autograd holds for backward
    (``torch.autograd.graph.saved_tensors_hooks``; a storage counts its current size, so params
    freed by resharding count 0);
  - ``param+grad+optim state``: bytes of this rank's sharded params, grads and AdamW state.
* bytes communicated per step per rank: every ``torch.distributed`` collective the step issues is
  counted as ring-algorithm wire bytes sent per rank (all-gather and reduce-scatter:
  (W-1)/W x full buffer; all-reduce: 2(W-1)/W x buffer), against the theoretical minimum for fp32
  FSDP with reshard_after_forward and a root that keeps its params after forward::

      min = (W-1)/W x (3 P - P_root)     (all-gather fwd P + all-gather bwd P - P_root + reduce-scatter P)

  with P the model's param bytes and P_root the root module's own param bytes; the plain
  3 (W-1)/W P (root resharded too) is printed beside it.

The two engines must agree: per-rank losses over every step equal within 1e-5, else exit 1.
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import math
import os
import pstats
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from typing import Any

LOSS_ATOL = 1e-5


# -- launcher ---------------------------------------------------------------------------------
def _reexec_under_torchrun() -> None:
    nproc = os.environ.get("BENCH_NPROC", "2")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        nproc,
        os.path.abspath(__file__),
        *sys.argv[1:],
    ]
    os.execv(sys.executable, cmd)


if __name__ == "__main__" and "LOCAL_RANK" not in os.environ:
    _reexec_under_torchrun()

import torch  # noqa: E402  (after the re-exec, which needs no torch)

torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("WORLD_SIZE", "1"))))

import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# the repo root on sys.path, so ``hyper_parallel`` imports without an install
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- model ------------------------------------------------------------------------------------
class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and a GELU MLP."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        qkv = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, vocab: int, hidden: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def root_param_numel(model: TinyDecoder) -> int:
    """Params the root group owns (everything outside the blocks)."""
    in_blocks = {id(p) for p in model.blocks.parameters()}
    return sum(p.numel() for p in model.parameters() if id(p) not in in_blocks)


# -- engines ----------------------------------------------------------------------------------
def shard_ours(model: TinyDecoder, mesh: DeviceMesh) -> None:
    from hyper_parallel import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh, comm_fusion=True)
    fully_shard(model, mesh=mesh, comm_fusion=True)


def shard_fsdp2(model: TinyDecoder, mesh: DeviceMesh) -> None:
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


ENGINES: dict[str, Callable[[TinyDecoder, DeviceMesh], None]] = {
    "ours": shard_ours,
    "fsdp2": shard_fsdp2,
}


# -- communication counter --------------------------------------------------------------------
# name -> how its wire bytes per rank are computed from its (args, kwargs) and the group size
def _nbytes(t: Any) -> int:
    if isinstance(t, torch.Tensor):
        return t.numel() * t.element_size()
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return 0


def _arg(args: tuple, kwargs: dict, index: int, *names: str) -> Any:
    if len(args) > index:
        return args[index]
    for name in names:
        if name in kwargs:
            return kwargs[name]
    return None


def _gather_bytes(args: tuple, kwargs: dict, w: int) -> float:  # (output, input): output is full
    return (w - 1) / w * _nbytes(_arg(args, kwargs, 0, "output_tensor", "output", "tensor_list"))


def _scatter_bytes(args: tuple, kwargs: dict, w: int) -> float:  # (output, input): input is full
    return (w - 1) / w * _nbytes(_arg(args, kwargs, 1, "input", "input_tensor", "input_list"))


def _all_reduce_bytes(args: tuple, kwargs: dict, w: int) -> float:
    return 2 * (w - 1) / w * _nbytes(_arg(args, kwargs, 0, "tensor"))


def _broadcast_bytes(args: tuple, kwargs: dict, w: int) -> float:
    return float(_nbytes(_arg(args, kwargs, 0, "tensor")))


def _no_bytes(args: tuple, kwargs: dict, w: int) -> float:
    return 0.0


_COLLECTIVES: dict[str, Callable[[tuple, dict, int], float]] = {
    "all_gather_single": _gather_bytes,
    "all_gather_into_tensor": _gather_bytes,
    "_all_gather_base": _gather_bytes,
    "all_gather": _gather_bytes,
    "reduce_scatter_single": _scatter_bytes,
    "reduce_scatter_tensor": _scatter_bytes,
    "_reduce_scatter_base": _scatter_bytes,
    "reduce_scatter": _scatter_bytes,
    "all_reduce": _all_reduce_bytes,
    "all_to_all_single": _scatter_bytes,
    "broadcast": _broadcast_bytes,
    "barrier": _no_bytes,
}


class CommCounter:
    """Wraps the ``torch.distributed`` collectives; counts calls and wire bytes while ``active``.

    Aliases that call one another are counted once, at the outermost call.
    """

    def __init__(self) -> None:
        self.active = False
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._depth = 0
        self._originals: dict[str, Callable] = {}

    def install(self) -> None:
        for name, size_of in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original, size_of))

    def uninstall(self) -> None:
        for name, original in self._originals.items():
            setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable, size_of: Callable) -> Callable:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if self.active and self._depth == 0:
                group = kwargs.get("group")
                world = dist.get_world_size(group)
                self.calls[name] += 1
                self.bytes[name] += size_of(args, kwargs, world)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        wrapper.__wrapped__ = original
        return wrapper

    def reset(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    @contextmanager
    def recording(self):
        self.active = True
        try:
            yield
        finally:
            self.active = False


class CollectiveOpSpy(TorchDispatchMode):
    """Counts collective ops at the dispatcher, a cross-check of ``CommCounter``.

    ``c10d`` ops are what the ``torch.distributed`` calls become (they should match the counted
    calls); ``_c10d_functional`` ops are collectives that bypass ``torch.distributed`` (DTensor
    redistribution, functional collectives) and would be missing from the byte count.
    """

    def __init__(self) -> None:
        super().__init__()
        self.c10d: Counter[str] = Counter()
        self.functional: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "c10d":
            self.c10d[func.__name__] += 1
        elif func.namespace in ("_c10d_functional", "c10d_functional"):
            self.functional[func.__name__] += 1
        return func(*args, **(kwargs or {}))


# -- memory -----------------------------------------------------------------------------------
class SavedTensorPeak:
    """Peak bytes of the distinct storages autograd holds for backward."""

    def __init__(self) -> None:
        self.live: dict[int, list] = {}  # storage key -> [storage, refcount]
        self.peak = 0

    def _sample(self) -> None:
        total = sum(st.nbytes() for st, _ in self.live.values())
        self.peak = max(self.peak, total)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        try:
            storage = local.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return t
        key = storage._cdata
        entry = self.live.setdefault(key, [storage, 0])
        entry[1] += 1
        self._sample()
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        local = t._local_tensor if isinstance(t, DTensor) else t
        try:
            key = local.untyped_storage()._cdata
        except (RuntimeError, NotImplementedError):
            return t
        self._sample()
        entry = self.live.get(key)
        if entry is not None:
            entry[1] -= 1
            if entry[1] == 0:
                del self.live[key]
        return t

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _local_bytes(t: torch.Tensor | None) -> int:
    if t is None:
        return 0
    local = t._local_tensor if isinstance(t, DTensor) else t
    return local.numel() * local.element_size()


def state_bytes(model: nn.Module, optim: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    opt = sum(_local_bytes(v) for s in optim.state.values() for v in s.values() if isinstance(v, torch.Tensor))
    return {
        "params": sum(_local_bytes(p) for p in params),
        "grads": sum(_local_bytes(p.grad) for p in params),
        "optim_state": opt,
    }


# -- the runs ---------------------------------------------------------------------------------
class EngineRun:
    """One engine's model (a fresh deep copy of the base, sharded bottom-up) and its AdamW."""

    def __init__(self, name: str, base: TinyDecoder, mesh: DeviceMesh, device: torch.device) -> None:
        self.name = name
        self.model = copy.deepcopy(base).to(device)
        ENGINES[name](self.model, mesh)
        self.optim = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        self.losses: list[float] = []
        self.times: list[float] = []
        self.cpu_times: list[float] = []
        self.step_bytes: list[float] = []
        self.calls: Counter[str] = Counter()
        self.bytes_by_op: Counter[str] = Counter()
        self.memory: dict[str, Any] = {}

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        self.optim.zero_grad(set_to_none=True)
        logits = self.model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        self.optim.step()
        return loss.detach()

    def timed_step(self, tokens: torch.Tensor, comm: CommCounter, device: torch.device) -> None:
        dist.barrier()
        _sync(device)
        comm.reset()
        start, cpu_start = time.perf_counter(), time.process_time()
        with comm.recording():
            loss = self.step(tokens)
            _sync(device)
        self.times.append(time.perf_counter() - start)
        self.cpu_times.append(time.process_time() - cpu_start)
        self.losses.append(loss.item())
        self.step_bytes.append(sum(comm.bytes.values()))
        self.calls.update(comm.calls)
        self.bytes_by_op.update(comm.bytes)

    def memory_step(self, tokens: torch.Tensor, device: torch.device) -> None:
        """One untimed step under the memory measures."""
        dist.barrier()
        saved = SavedTensorPeak()
        spy = CollectiveOpSpy()
        tracker = None
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            ctx: Any = nullcontext()
        else:
            from torch.distributed._tools.mem_tracker import MemTracker

            tracker = MemTracker()
            tracker.track_external(self.model, self.optim)
            ctx = tracker
        with ctx, spy, saved.hooks():
            self.losses.append(self.step(tokens).item())
        if tracker is None:
            peak = torch.cuda.max_memory_allocated(device)
        else:
            peak = tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0)
        self.memory = {
            "peak_tensor_bytes": int(peak),
            "saved_for_backward_peak_bytes": saved.peak,
            "state_bytes": state_bytes(self.model, self.optim),
            "c10d_ops_memory_step": dict(spy.c10d),
            "functional_collective_ops_memory_step": dict(spy.functional),
        }

    def profile(self, batches: list[torch.Tensor], rank: int) -> str:
        """cProfile these steps on rank 0 (the other ranks run them unprofiled)."""
        profiler = cProfile.Profile() if rank == 0 else None
        dist.barrier()
        if profiler is not None:
            profiler.enable()
        for tokens in batches:
            self.step(tokens)
        if profiler is None:
            return ""
        profiler.disable()
        out = io.StringIO()
        stats = pstats.Stats(profiler, stream=out)
        out.write(f"--- top 30 by tottime over {len(batches)} steps ---\n")
        stats.sort_stats("tottime").print_stats(30)
        out.write(f"--- top 45 by cumulative time over {len(batches)} steps ---\n")
        stats.sort_stats("cumulative").print_stats(45)
        out.write("--- the engine's own functions (hyper_parallel / fsdp/_fully_shard), by cumulative ---\n")
        stats.sort_stats("cumulative").print_stats(r"hyper_parallel|_fully_shard", 30)
        return out.getvalue()

    def result(self, steps: int) -> dict[str, Any]:
        return {
            "losses": self.losses,
            "step_ms": [t * 1e3 for t in self.times],
            "median_ms": statistics.median(self.times) * 1e3,
            "min_ms": min(self.times) * 1e3,
            "median_cpu_ms": statistics.median(self.cpu_times) * 1e3,
            "comm_bytes_per_step": statistics.mean(self.step_bytes),
            "comm_bytes_per_step_min_max": [min(self.step_bytes), max(self.step_bytes)],
            "comm_calls_per_step": {k: v / steps for k, v in self.calls.items()},
            "comm_bytes_by_op_per_step": {k: v / steps for k, v in self.bytes_by_op.items()},
            **self.memory,
        }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_all(
    names: list[str],
    base: TinyDecoder,
    mesh: DeviceMesh,
    batches: list[torch.Tensor],
    args: argparse.Namespace,
    comm: CommCounter,
    device: torch.device,
    rank: int,
) -> tuple[dict[str, dict[str, Any]], dict[str, str]]:
    """Train every engine on the same batches, interleaved step by step.

    Interleaving (and swapping which engine goes first each step) exposes both engines to the
    same machine noise, which on a shared 2-core box varies by tens of percent over a run.
    """
    runs = [EngineRun(name, base, mesh, device) for name in names]
    it = iter(batches)
    for i in range(args.warmup):
        tokens = next(it)
        for run in runs if i % 2 == 0 else runs[::-1]:
            run.losses.append(run.step(tokens).item())
    for i in range(args.steps):
        tokens = next(it)
        for run in runs if i % 2 == 0 else runs[::-1]:
            run.timed_step(tokens, comm, device)
    tokens = next(it)
    for run in runs:
        run.memory_step(tokens, device)
    profiles = {}
    if args.profile:
        extra = [next(it) for _ in range(args.profile)]
        profiles = {run.name: run.profile(extra, rank) for run in runs}
    return {run.name: run.result(args.steps) for run in runs}, profiles


# -- report -----------------------------------------------------------------------------------
def _mib(n: float) -> str:
    return f"{n / 2**20:9.2f} MiB"


def _ms(v: float) -> str:
    return f"{v:9.2f} ms  "


def _ratio(a: float, b: float) -> str:
    return f"{a / b:6.3f}" if b else "   n/a"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="measured steps")
    parser.add_argument("--warmup", type=int, default=3, help="warm-up steps before measuring")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--order", default="ours,fsdp2", help="which engine steps first (then alternating)")
    parser.add_argument("--loss-atol", type=float, default=LOSS_ATOL, help="max |loss diff| allowed")
    parser.add_argument("--json", default=None, help="write the numbers to this file (rank 0)")
    parser.add_argument("--profile", type=int, default=0, help="cProfile N extra steps of each engine")
    args = parser.parse_args()
    engines = [e.strip() for e in args.order.split(",")]
    if sorted(engines) != sorted(ENGINES):
        parser.error(f"--order must list each of {sorted(ENGINES)} once")

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(args.seed)
    base = TinyDecoder(args.vocab, args.hidden, args.layers, args.heads)
    n_params = sum(p.numel() for p in base.parameters())
    param_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    root_bytes = root_param_numel(base) * 4
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank + 1)
    n_batches = args.warmup + args.steps + 1 + args.profile
    batches = [
        torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device) for _ in range(n_batches)
    ]

    comm = CommCounter()
    comm.install()
    wall = time.perf_counter()
    try:
        results, profiles = run_all(engines, base, mesh, batches, args, comm, device, rank)
    finally:
        comm.uninstall()
    wall = time.perf_counter() - wall

    # loss agreement, per rank, then the worst over ranks
    a, b = (results[e]["losses"] for e in ("ours", "fsdp2"))
    local_diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    finite = all(math.isfinite(x) for x in a + b)
    gathered: list[dict[str, Any]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(gathered, {"results": results, "loss_diff": local_diff, "finite": finite})
    max_diff = max(g["loss_diff"] for g in gathered)
    all_finite = all(g["finite"] for g in gathered)

    ok = all_finite and max_diff <= args.loss_atol
    if rank == 0:
        summary = summarize(gathered, args, world, n_params, param_bytes, root_bytes, engines)
        summary["loss_max_abs_diff"] = max_diff
        summary["loss_atol"] = args.loss_atol
        summary["losses_agree"] = ok
        summary["wall_s"] = wall
        print_table(summary)
        for name, text in profiles.items():
            print(f"\n===== cProfile of {name}, rank 0 =====")
            print(text)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=2, default=str)
            print(f"wrote {args.json}")
        if not ok:
            print(
                f"FAIL: losses of ours and FSDP2 differ by {max_diff:.3e} > {args.loss_atol:g}"
                + ("" if all_finite else " (non-finite loss)"),
                file=sys.stderr,
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


def summarize(
    gathered: list[dict[str, Any]],
    args: argparse.Namespace,
    world: int,
    n_params: int,
    param_bytes: int,
    root_bytes: int,
    engines: list[str],
) -> dict[str, Any]:
    frac = (world - 1) / world
    per_engine: dict[str, Any] = {}
    for name in engines:
        ranks = [g["results"][name] for g in gathered]
        per_engine[name] = {
            "median_step_ms_max_over_ranks": max(r["median_ms"] for r in ranks),
            "median_step_ms_per_rank": [r["median_ms"] for r in ranks],
            "min_step_ms_max_over_ranks": max(r["min_ms"] for r in ranks),
            "median_cpu_ms_max_over_ranks": max(r["median_cpu_ms"] for r in ranks),
            "peak_tensor_bytes_max_over_ranks": max(r["peak_tensor_bytes"] for r in ranks),
            "saved_for_backward_peak_bytes_max_over_ranks": max(r["saved_for_backward_peak_bytes"] for r in ranks),
            "state_bytes_max_over_ranks": max(sum(r["state_bytes"].values()) for r in ranks),
            "state_bytes_rank0": ranks[0]["state_bytes"],
            "comm_bytes_per_step_max_over_ranks": max(r["comm_bytes_per_step"] for r in ranks),
            "comm_calls_per_step_rank0": ranks[0]["comm_calls_per_step"],
            "comm_bytes_by_op_per_step_rank0": ranks[0]["comm_bytes_by_op_per_step"],
            "c10d_ops_memory_step_rank0": ranks[0]["c10d_ops_memory_step"],
            "functional_collective_ops_memory_step_rank0": ranks[0]["functional_collective_ops_memory_step"],
            "losses_rank0": ranks[0]["losses"],
            "step_ms_rank0": ranks[0]["step_ms"],
        }
    return {
        "config": {**vars(args), "world": world, "threads_per_rank": torch.get_num_threads()},
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "n_params": n_params,
        "param_bytes": param_bytes,
        "root_param_bytes": root_bytes,
        "comm_min_bytes_per_step": frac * (3 * param_bytes - root_bytes),
        "comm_min_formula": "(W-1)/W * (3*P - P_root)  [root keeps params after forward]",
        "comm_3x_bytes_per_step": 3 * frac * param_bytes,
        "engines": per_engine,
    }


def print_table(s: dict[str, Any]) -> None:
    cfg = s["config"]
    ours, fsdp2 = s["engines"]["ours"], s["engines"]["fsdp2"]
    mem_label = "cuda max_memory_allocated" if s["device"] == "cuda" else "MemTracker peak live tensors"
    print()
    print(
        f"hyper_parallel vs torch FSDP2 | {s['device']} x{cfg['world']} ranks, "
        f"{cfg['threads_per_rank']} thread(s)/rank, torch {s['torch']}"
    )
    print(
        f"model: TinyDecoder layers={cfg['layers']} hidden={cfg['hidden']} heads={cfg['heads']} "
        f"vocab={cfg['vocab']}  params={s['n_params']:,} ({_mib(s['param_bytes']).strip()}, "
        f"root-owned {_mib(s['root_param_bytes']).strip()})"
    )
    print(
        f"data: batch={cfg['batch']} seq={cfg['seq']} per rank; AdamW; "
        f"warmup={cfg['warmup']} measured={cfg['steps']} (+1 memory step)"
    )
    print()
    rows = [
        ("median step time (max over ranks)", "median_step_ms_max_over_ranks", _ms),
        ("  min step time (max over ranks)", "min_step_ms_max_over_ranks", _ms),
        ("  median process CPU time/step (all threads)", "median_cpu_ms_max_over_ranks", _ms),
        (f"peak memory: {mem_label}", "peak_tensor_bytes_max_over_ranks", _mib),
        ("peak memory: saved-for-backward peak", "saved_for_backward_peak_bytes_max_over_ranks", _mib),
        ("memory: param+grad+AdamW state (sharded)", "state_bytes_max_over_ranks", _mib),
        ("comm bytes/step/rank (ring wire bytes)", "comm_bytes_per_step_max_over_ranks", _mib),
    ]
    w = 44
    print(f"{'metric':<{w}} {'ours':>14} {'FSDP2':>14} {'ours/FSDP2':>11}")
    print("-" * (w + 42))
    for label, key, fmt in rows:
        print(f"{label:<{w}} {fmt(ours[key]):>14} {fmt(fsdp2[key]):>14} {_ratio(ours[key], fsdp2[key]):>11}")
    print("-" * (w + 42))
    mn = s["comm_min_bytes_per_step"]
    print(f"{'comm theoretical min/step/rank':<{w}} {_mib(mn):>14}   {s['comm_min_formula']}")
    print(f"{'  (3*(W-1)/W*P, root resharded too)':<{w}} {_mib(s['comm_3x_bytes_per_step']):>14}")
    for name, e in (("ours", ours), ("FSDP2", fsdp2)):
        ratio = _ratio(e["comm_bytes_per_step_max_over_ranks"], mn)
        print(f"{'comm / theoretical min, ' + name:<{w}} {ratio:>14}")
    print()
    for name, e in (("ours", ours), ("FSDP2", fsdp2)):
        calls = ", ".join(f"{k} x{v:g}" for k, v in sorted(e["comm_calls_per_step_rank0"].items()))
        print(f"collectives/step (rank 0), {name}: {calls}")
        ops = ", ".join(f"{k} x{v}" for k, v in sorted(e["c10d_ops_memory_step_rank0"].items()))
        print(f"  cross-check, c10d ops at the dispatcher in the memory step: {ops or 'none'}")
        functional = e["functional_collective_ops_memory_step_rank0"]
        if functional:
            print(f"  WARNING functional collectives, not in the byte count: {functional}")
    print(
        "per-rank median step ms: "
        + "; ".join(
            f"{n}: " + ", ".join(f"{v:.1f}" for v in e["median_step_ms_per_rank"])
            for n, e in (("ours", ours), ("FSDP2", fsdp2))
        )
    )
    verdict = "OK" if s["losses_agree"] else "MISMATCH"
    print(
        f"losses: max |ours - FSDP2| over {len(ours['losses_rank0'])} steps x ranks = "
        f"{s['loss_max_abs_diff']:.3e} (atol {s['loss_atol']:g}) -> {verdict}; "
        f"first/last loss rank 0: {ours['losses_rank0'][0]:.4f} / {ours['losses_rank0'][-1]:.4f}"
    )
    print(f"wall time of both runs: {s['wall_s']:.1f} s")


if __name__ == "__main__":
    sys.exit(main())
