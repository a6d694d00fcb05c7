"""What the implementation hands the user's code at two points the numbers at a step's end can miss
(a mixin of ``oracle.Example``):

- the tensor an all-reduce hook receives. L4's hooks record it before they map it: it must be in the
  reduce dtype and, where the call's reduction ends in the all-reduce over the replicas (a 2-D mesh
  with that all-reduce on), the output of that all-reduce, so the same on every replica; FSDP2's
  ``set_all_reduce_hook``: "the reduce-scatter output if only using FSDP or the all-reduce output
  if using native HSDP". (A linear hook gives the same grads before or after the all-reduce; the
  ``leaky`` map does not, which the grads then show too.)
- the params a module computes with in the first forward after ``unshard(async_op=True)`` issued
  before the optimizer step and waited after it: the stepped ones, bit for bit (the shards after
  the step, cast as the policy casts), not the copy the all-gather made when it was issued.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from tests.kit.explore.gathers import Unit
from tests.kit.explore.promised import HOOK_MAPS
from tests.kit.explore.space import Group
from tests.kit.judging.reference import full
from tests.kit.judging.surface import impl
from tests.kit.runtime.devices import compute_device


class Received:
    """The all-reduce hooks' inputs and the params after an unshard across the optimizer step."""

    hook_inputs: dict[int, list[torch.Tensor]]  # call -> what its hook received this step
    stepped: tuple[Unit, dict[str, torch.Tensor]] | None  # the unit unsharded across the step, its stepped params

    # -- the all-reduce hook ------------------------------------------------------------------
    def _all_reduce_hook(self, index: int, group: Group) -> Callable[[torch.Tensor], None]:
        """Call ``index``'s hook: records a copy of what it receives, then maps it as drawn."""
        apply = HOOK_MAPS[group.hook_map]

        def hook(reduced: torch.Tensor) -> None:
            # this step's list, looked up at each call: each step's check pops it, and a list held by
            # the hook would keep every copy alive and hide the steps after the first from the check
            self.hook_inputs.setdefault(index, []).append(reduced.detach().clone())
            apply(reduced)

        return hook

    def _check_hook_inputs(self, where: str) -> None:
        """What each call's hook received in this step: the reduce dtype, and the same on every
        replica where it follows the all-reduce over them (a collective over the replica group:
        every rank reaches it, with the same calls, whatever it received)."""
        for index, group in enumerate(self.config.groups):
            received = self.hook_inputs.pop(index, [])
            if not group.hook:
                continue
            label = f"{where} call {index}: the all-reduce hook's input"
            dtypes = sorted({str(t.dtype) for t in received})
            if dtypes:
                self.ctx.equal(
                    f"{label}: its dtype (the reduce dtype)", str(dtypes), str([str(self.reference.reduce_dtype)])
                )
            replicas = self.meshes.replicate_group(group.mesh)
            if replicas is None or self.config.mesh[0] < 2 or not self.reference.all_reduce[index]:
                continue
            flat = [t.reshape(-1).double() for t in received]
            mine = (torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64)).to(compute_device())
            count = torch.tensor([mine.numel()], device=mine.device)
            counts = [torch.zeros_like(count) for _ in range(self.config.mesh[0])]
            dist.all_gather(counts, count, group=replicas)
            sizes = [int(c) for c in counts]
            if not self.ctx.equal(f"{label}: as many elements on every replica", sizes, [mine.numel()] * len(sizes)):
                continue  # every rank of the group saw the same sizes: none gathers the values
            theirs = [torch.empty_like(mine) for _ in sizes]
            dist.all_gather(theirs, mine, group=replicas)
            me = dist.get_rank(group=replicas)
            for replica, other in enumerate(theirs):
                if replica == me:
                    continue
                self.ctx.equal(
                    f"{label} equals replica {replica}'s (it follows the all-reduce over the replicas)", mine, other
                )

    # -- an unshard across the optimizer step ---------------------------------------------------
    def _note_stepped(self, unit: Unit) -> None:
        """Right after the optimizer step (the unshard of ``unit`` issued, not waited): its own
        params' stepped values, whole (the shards are registered while the gather is in flight)."""
        params = dict(self.model.named_parameters())
        own = [path for path in self._own_numels(*unit) if self.plans[path].kind != "ignored"]
        self.stepped = unit, {path: full(params[path]).detach().clone() for path in own}

    def _check_stepped(self, unit: Unit) -> None:
        """As ``unit``'s module starts its first forward after the unshard across the step, after the
        implementation's pre-forward: its params, unsharded, are the stepped ones cast as computed."""
        if self.stepped is None or self.stepped[0] != unit or not self._recording_forward:
            return
        _, stepped = self.stepped
        self.stepped = None
        params = dict(self.model.named_parameters())
        for path, want in stepped.items():
            now = impl.local(params[path]).detach()
            if tuple(now.shape) != tuple(want.shape):
                continue  # not unsharded: the numels checks say so
            self.ctx.equal(
                f"{self._where} forward, call {unit[0]} unsharded across the optimizer step: {path} "
                "computes with the stepped param",
                now,
                want.to(device=now.device, dtype=now.dtype),
            )
