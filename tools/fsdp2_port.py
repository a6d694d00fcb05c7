"""Port an FSDP2 script to an implementation and see which usages hold: the issue-22 table.

Each usage runs on gloo CPU ranks (every rank on the same batch), sharded through the implementation
named on the command line, and is compared with the unsharded model trained on that batch::

    python -m tools.fsdp2_port            # ours, then torch FSDP2
    python -m tools.fsdp2_port ours

A usage passes when it runs and its params (and grads, where the usage is about them) equal the
unsharded model's within 1e-5 after two SGD steps. A development tool, not part of ``make test``:
the kit's L0-FSDP2-* cases judge the same usages against DDP.
"""

from __future__ import annotations

import copy
import os
import socket
import sys
import traceback
from collections.abc import Callable
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

TOL = 1e-5
USAGES: dict[str, tuple[int, Callable]] = {}  # name -> (world size, body(api, rank) -> str | None)


def usage(name: str, world: int = 2) -> Callable:
    def register(body: Callable) -> Callable:
        USAGES[name] = (world, body)
        return body

    return register


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 16), nn.Linear(16, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers[1](torch.relu(self.layers[0](x)))

    def generate(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward(x) * 2


def api_of(name: str) -> SimpleNamespace:
    if name == "ours":
        import hyper_parallel as hp

        return SimpleNamespace(fully_shard=hp.fully_shard, register=hp.register_fsdp_forward_method)
    from torch.distributed import fsdp

    return SimpleNamespace(fully_shard=fsdp.fully_shard, register=fsdp.register_fsdp_forward_method)


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def shard(api: SimpleNamespace, model: MLP, **kw) -> MLP:
    for layer in model.layers:
        api.fully_shard(layer, **kw)
    return api.fully_shard(model, **kw)


def train(model: nn.Module, steps: int = 2, call: str = "forward", dtype: torch.dtype = torch.float32) -> list:
    """Two SGD steps on one seeded batch; the grads of each step."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1), dtype=dtype)
    grads = []
    for _ in range(steps):
        getattr(model, call)(x).square().mean().backward()
        grads.append([full(p.grad).clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
    return grads


def compare(model: nn.Module | None, ref: nn.Module, grads=None, ref_grads=None, scale: float = 1.0) -> str | None:
    for (name, p), q in zip(model.named_parameters() if model else (), ref.parameters(), strict=False):
        err = (full(p).detach() - q.detach()).abs().max().item()
        if err > TOL or full(p).dtype != q.dtype:
            return f"param {name}: err {err:.2e}, dtype {full(p).dtype} vs {q.dtype}"
    for step, (gs, rs) in enumerate(zip(grads or [], ref_grads or [], strict=True)):
        for g, r in zip(gs, rs, strict=True):
            err = (g - r * scale).abs().max().item()
            if err > TOL:
                return f"step {step} grad err {err:.2e}"
    return None


def twins() -> tuple[MLP, MLP]:
    torch.manual_seed(0)
    model = MLP()
    return model, copy.deepcopy(model)


@usage("deferred init + DCP full load")
def deferred_init(api: SimpleNamespace, rank: int) -> str | None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    _, ref = twins()
    with torch.device("meta"):
        model = MLP()
    shard(api, model)
    model.to_empty(device="cpu")
    full_sd = ref.state_dict() if rank == 0 else {}
    set_model_state_dict(model, full_sd, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    return compare(model, ref, train(model), train(ref))


@usage("deferred init + reset_parameters()")
def reset_parameters(api: SimpleNamespace, rank: int) -> str | None:
    with torch.device("meta"):
        model = MLP()
    shard(api, model)
    model.to_empty(device="cpu")
    for layer in model.layers:
        layer.reset_parameters()
    ref = MLP()
    ref.load_state_dict({k: full(v) for k, v in model.state_dict().items()})
    return compare(model, ref, train(model), train(ref))


@usage("reshard_after_forward=1 (int)")
def reshard_int_one(api: SimpleNamespace, rank: int) -> str | None:
    model, ref = twins()
    shard(api, model, reshard_after_forward=1)
    return compare(model, ref, train(model), train(ref))


@usage("reshard_after_forward=2 (int) of 4", world=4)
def reshard_int_two(api: SimpleNamespace, rank: int) -> str | None:
    model, ref = twins()
    shard(api, model, reshard_after_forward=2)
    return compare(model, ref, train(model), train(ref))


@usage("model.to(torch.float64) after fully_shard")
def to_float64(api: SimpleNamespace, rank: int) -> str | None:
    model, ref = twins()
    shard(api, model)
    model.to(torch.float64)
    ref.to(torch.float64)
    grads = train(model, dtype=torch.float64)
    if any(g.dtype != torch.float64 for g in grads[0]):
        return "grads are not float64"
    return compare(model, ref, grads, train(ref, dtype=torch.float64))


@usage("register_fsdp_forward_method(generate)")
def forward_method(api: SimpleNamespace, rank: int) -> str | None:
    model, ref = twins()
    shard(api, model)
    api.register(model, "generate")
    return compare(model, ref, train(model, call="generate"), train(ref, call="generate"))


@usage("set_all_reduce_hook (HSDP 2x2)", world=4)
def all_reduce_hook(api: SimpleNamespace, rank: int) -> str | None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model, ref = twins()
    shard(api, model, mesh=mesh)
    for module in (*model.layers, model):
        module.set_all_reduce_hook(lambda output: output.mul_(2.0))
    model_grads = train(model, steps=1)
    return compare(None, ref, model_grads, train(ref, steps=1), scale=2.0)


@usage("set_unshard_in_backward(False)")
def unshard_in_backward(api: SimpleNamespace, rank: int) -> str | None:
    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 4))

    model, ref = net(), net()
    api.fully_shard(model[0]).set_unshard_in_backward(False)
    api.fully_shard(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, ref))
    ids = torch.arange(6) % 10
    for m, o in ((model, opt), (ref, ref_opt)):
        for _ in range(2):
            m(ids).square().mean().backward()
            o.step()
            o.zero_grad()
    return compare(model, ref)


@usage("set_gradient_divide_factor(1.0)")
def divide_factor(api: SimpleNamespace, rank: int) -> str | None:
    model, ref = twins()
    shard(api, model)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    grads = train(model, steps=1)
    return compare(None, ref, grads, train(ref, steps=1), scale=float(dist.get_world_size()))


@usage("DCP optimizer state dict, clip_grad_norm_, torch.compile")
def composes(api: SimpleNamespace, rank: int) -> str | None:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    model, ref = twins()
    shard(api, model)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    compiled = torch.compile(model, backend="eager")
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    compiled(x).square().mean().backward()
    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    set_optimizer_state_dict(model, opt, get_optimizer_state_dict(model, opt))
    return None


def worker(rank: int, world: int, port: int, impl: str, name: str, results: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        problem = USAGES[name][1](api_of(impl), rank)
        results[rank] = "ok" if problem is None else f"mismatch: {problem}"
    except Exception as exc:  # the usage's own error is what the table reports
        results[rank] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:150]}"
        if os.environ.get("PORT_TRACE"):
            traceback.print_exc()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(impl: str, name: str) -> str:
    world = USAGES[name][0]
    with mp.Manager() as manager:
        results = manager.dict()
        ctx = mp.spawn(worker, args=(world, free_port(), impl, name, results), nprocs=world, join=False)
        if not ctx.join(timeout=120):
            ctx.join(timeout=120)
        return results.get(0, "no result (a rank died or hung)")


def main(argv: list[str]) -> int:
    impls = argv or ["ours", "fsdp2"]
    print("| usage | " + " | ".join(impls) + " |")
    print("|---|" + "---|" * len(impls))
    failed = 0
    for name in USAGES:
        cells = [run(impl, name) for impl in impls]
        failed += cells[0] != "ok"
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
