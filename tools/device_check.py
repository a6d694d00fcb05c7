"""The device check: our engine on whatever accelerator torch reports, at world size 1.

    python -m torch.distributed.run --standalone --nproc-per-node 1 tools/device_check.py

(``tools/device_check.sh`` runs it, then ``benchmarks/bench_fsdp2.py`` on the L3 decoder.) Each
check prints one line, ``ok`` or ``FAIL`` with what it saw; the exit status is 1 if any failed.
On a CPU-only host it runs on the CPU and says so (the accelerator parts are then no proof).

1. bf16 and fp16 policies on the accelerator: loss, grads and params against the same-dtype
   reference on the same device (the registry's half-precision rows);
2. CPU offload with pinned memory: shards on the host, pinned, and the training equal to the
   same model without offload;
3. the memory probe on the accelerator's allocator: a forward + backward's peak lower with
   activation checkpointing than without;
4. the plan's bitwise rerun with the deterministic settings (``tests.kit.runtime.devices.deterministic``):
   two runs of the L3 decoder from one seed, equal bit for bit.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from tests.kit.judging.memory import peak_memory  # noqa: E402
from tests.kit.judging.reference import SameDtypeReference  # noqa: E402
from tests.kit.judging.surface import impl  # noqa: E402
from tests.kit.judging.tolerances import tolerance  # noqa: E402
from tests.kit.runtime import devices  # noqa: E402
from tests.kit.workloads.models import DIMS, MLP, Checkpointed, FeedForwardStack  # noqa: E402
from tests.kit.workloads.networks import LLM_SEQ, cross_entropy_loss, llm_decoder, token_batch  # noqa: E402

FAILED: list[str] = []


def report(name: str, ok: bool, seen: str = "") -> None:
    print(f"{'ok  ' if ok else 'FAIL'}  {name}  {seen}", flush=True)
    if not ok:
        FAILED.append(name)


def max_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return (impl.full(a).detach().double().cpu() - impl.full(b).detach().double().cpu()).abs().max().item()


def policies(mesh, device: torch.device) -> None:
    """bf16 and fp16 compute on the device against the same-dtype reference there."""
    for dtype, row in ((torch.bfloat16, "FSDP 1D bf16"), (torch.float16, "FSDP 1D fp16")):
        tol = tolerance(row)
        model = MLP(DIMS).to(device)
        reference = SameDtypeReference(model, dtype, torch.float32)
        for module in (*model.layers, model):
            impl.fully_shard(module, mesh=mesh, mp_policy=impl.MixedPrecisionPolicy(dtype, torch.float32))
        opts = torch.optim.Adam(model.parameters(), lr=1e-2), torch.optim.Adam(reference.parameters(), lr=1e-2)
        worst = 0.0
        for step in range(2):
            x = torch.randn(4, DIMS[0], generator=torch.Generator().manual_seed(step)).to(device)
            loss = model(x).float().square().mean()
            loss.backward()
            ref_loss = reference(x).float().square().mean()
            ref_loss.backward()
            reference.reduce_grads()
            worst = max(worst, abs(loss.item() - ref_loss.item()))
            for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                worst = max(worst, max_error(p.grad, q.grad))
            for opt in opts:
                opt.step()
                opt.zero_grad()
        report(
            f"{dtype} policy on {device.type}: loss and grads vs the same-dtype reference",
            worst <= tol.grad,
            f"worst {worst:.2e} (tol {tol.grad:g})",
        )


def offload(mesh, device: torch.device) -> None:
    """CPU offload with pinned memory: the shards on the host, pinned, training as without offload."""
    plain, offloaded = MLP(DIMS).to(device), MLP(DIMS).to(device)
    for model, policy in ((plain, None), (offloaded, impl.CPUOffloadPolicy(pin_memory=True))):
        for module in (*model.layers, model):
            impl.fully_shard(module, mesh=mesh, **({"offload_policy": policy} if policy else {}))
    shards = [impl.local(p) for p in offloaded.parameters()]
    on_host = all(s.device.type == "cpu" for s in shards)
    pinned = all(s.is_pinned() for s in shards) if devices.has_allocator(device) else None
    report("CPU offload: shards on the host", on_host, str({s.device.type for s in shards}))
    report(
        "CPU offload: host shards pinned", pinned is not False, "no accelerator: not pinned" if pinned is None else ""
    )
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (plain, offloaded)]
    worst = 0.0
    for step in range(2):
        x = torch.randn(4, DIMS[0], generator=torch.Generator().manual_seed(10 + step)).to(device)
        losses = []
        for model, opt in zip((plain, offloaded), opts, strict=True):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        worst = max(worst, abs(losses[0] - losses[1]))
    for p, q in zip(plain.parameters(), offloaded.parameters(), strict=True):
        worst = max(worst, max_error(p, q))
    report(
        "CPU offload: training equals the model without offload",
        worst <= tolerance("FSDP 1D fp32").grad,
        f"worst {worst:.2e}",
    )


def memory(mesh, device: torch.device) -> None:
    """The probe on the allocator: activation checkpointing lowers the peak of forward + backward."""
    peaks = {}
    for label, checkpointed in (("without AC", False), ("with AC", True)):
        model = FeedForwardStack(256, 1024, 6).to(device)
        if checkpointed:
            for i, block in enumerate(model.blocks):
                model.blocks[i] = Checkpointed(block, use_reentrant=False)
        for block in model.blocks:
            impl.fully_shard(block, mesh=mesh)
        impl.fully_shard(model, mesh=mesh)
        x = torch.randn(512, 256, device=device)
        with peak_memory(device, holding=[model]) as peak:
            model(x).square().mean().backward()
        peaks[label] = peak
    without, with_ac = peaks["without AC"], peaks["with AC"]
    report(
        f"memory probe ({with_ac.what}): peak with AC < without AC",
        with_ac.bytes < without.bytes,
        f"{with_ac.bytes} < {without.bytes} bytes",
    )


def bitwise_rerun(mesh, device: torch.device, settings: dict) -> None:
    """Two runs of the L3 decoder from one seed under the deterministic settings: bit for bit."""
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        model = llm_decoder().to(device)
        for layer in model.layers:
            impl.fully_shard(layer, mesh=mesh)
        impl.fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        seen = []
        for step in range(2):
            tokens, targets = (t.to(device) for t in token_batch(step, 0, 2, LLM_SEQ, model.config.vocab))
            loss = cross_entropy_loss(model(tokens), targets)
            loss.backward()
            seen.append(loss.detach().clone())
            seen.extend(impl.local(p.grad).detach().clone() for p in model.parameters())
            opt.step()
            opt.zero_grad()
        runs.append(seen)
    same = all(torch.equal(a, b) for a, b in zip(*runs, strict=True))
    report(f"bitwise rerun of the L3 decoder on {device.type} ({settings})", same)


def main() -> int:
    accelerator = devices.accelerator_type()
    device_type, backend = devices.choose(None, 1)
    devices.bind(device_type, int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    device = devices.compute_device()
    settings = devices.deterministic(device_type)
    where = accelerator or "no accelerator: the CPU"
    print(f"device check: {device} ({where}), backend {backend}, torch {torch.__version__}")
    mesh = impl.init_mesh(device_type, (1,), ("dp",))
    started = time.monotonic()
    for check in (policies, offload, memory):
        check(mesh, device)
    bitwise_rerun(mesh, device, settings)
    dist.destroy_process_group()
    print(
        f"{'all checks passed' if not FAILED else 'FAILED: ' + ', '.join(FAILED)} ({time.monotonic() - started:.0f} s)"
    )
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
