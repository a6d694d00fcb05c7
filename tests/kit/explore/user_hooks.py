"""The user's hooks on params, an L4 invariant (a mixin of ``oracle.Example``): hooks a user puts on a
param are still called once ``fully_shard`` has swapped what the module holds (upstream's reports of a
swap losing them). After sharding: a ``register_post_accumulate_grad_hook`` on each trainable managed
param, called as its step's reduced grad lands (FSDP2's rule: at least once in a step whose last
reduction of the param's call is complete, seeing the grad). Before sharding (``hooks_through_sharding``,
which FSDP2 lacks): a ``register_hook`` on each one, called once per backward that computes its grad.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from torch import nn

from tests.kit.judging.surface import impl


class UserHooks:
    """Counts of the user's hooks per param path, and their checks at the end of each step."""

    def _hook_before_sharding(self) -> None:
        """``register_hook`` on every trainable param the calls manage, before the first call."""
        self.grad_hook_calls: Counter[str] = Counter()
        self.ref_hook_calls: Counter[str] = Counter()  # the same hooks on the reference's: the plain model's
        self.grads_computed: Counter[str] = Counter()
        self.before_sharding = "hooks_through_sharding" in impl.features
        self.hooked: set[str] = set()  # the params hooked (a param frozen then and unfrozen later is not)
        if not self.before_sharding:
            return
        for path, param in self.model.named_parameters():
            if self._hooked(path, param):
                param.register_hook(self._count(self.grad_hook_calls, path))
                self.reference.compute.get_parameter(path).register_hook(self._count(self.ref_hook_calls, path))
                self.hooked.add(path)

    def _hook_after_sharding(self) -> None:
        """``register_post_accumulate_grad_hook`` on every trainable managed param, as sharded."""
        self.landed_calls: Counter[str] = Counter()
        self.landed_without_grad: list[str] = []
        self.landed_hooked: set[str] = set()
        if "post_accumulate_grad_hooks" not in impl.features:
            return
        for path, param in self.model.named_parameters():
            if self._hooked(path, param):
                param.register_post_accumulate_grad_hook(self._landed(path))
                self.landed_hooked.add(path)

    def _hooked(self, path: str, param: nn.Parameter) -> bool:
        plan = self.plans.get(path)
        return plan is not None and plan.kind != "ignored" and plan.trainable and param.requires_grad

    @staticmethod
    def _count(counter: Counter[str], path: str) -> Any:
        def hook(grad: Any) -> None:
            counter[path] += 1

        return hook

    def _landed(self, path: str) -> Any:
        def hook(param: nn.Parameter) -> None:
            self.landed_calls[path] += 1
            if param.grad is None:
                self.landed_without_grad.append(path)

        return hook

    def _note_user_hooks(self) -> None:
        """After a micro-batch: the params whose grads its backward computed."""
        for path in self.reference.got_grad:
            self.grads_computed[path] += 1

    def _complete(self, group: int, mesh: str) -> bool:
        """Whether call ``group``'s last reduction of the step was complete: no replicas, or all-reduced."""
        return self.meshes.replicate_group(mesh) is None or self.reference.all_reduce[group]

    def _check_user_hooks(self, where: str) -> None:
        """The counts of this step, then reset for the next."""
        if self.before_sharding:
            for path in sorted(self.grads_computed):
                if path in self.hooked and self._hooked(path, self.model.get_parameter(path)):
                    self.ctx.equal(
                        f"{where} register_hook before fully_shard on {path}: calls (as on the plain model)",
                        self.grad_hook_calls[path],
                        self.ref_hook_calls[path],
                    )
        if "post_accumulate_grad_hooks" in impl.features:
            without = str(self.landed_without_grad)
            self.ctx.equal(f"{where} post-accumulate-grad hooks called without a grad", without, "[]")
            for path, param in self.model.named_parameters():
                plan = self.plans.get(path)
                if plan is None or param.grad is None or not self._complete(plan.group, plan.mesh):
                    continue
                if path in self.landed_hooked and self._hooked(path, param):
                    called = self.landed_calls[path]
                    self.ctx.true(f"{where} post-accumulate-grad hook on {path} called", called >= 1, called, ">= 1")
        self.grad_hook_calls.clear()
        self.ref_hook_calls.clear()
        self.grads_computed.clear()
        self.landed_calls.clear()
        self.landed_without_grad.clear()
