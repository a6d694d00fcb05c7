"""Usage patterns of torch FSDP2's users, as drawn options of L4's one grammar (a mixin of
``oracle.Example``; drawn by ``draws.patterns``, the model's part in ``grammar.Net``). Each composes
with every other feature and mesh, and is judged as any configuration is, against the promised
reference (the plain model's result):

- ``freeze_through_lazy_init`` (``Config.freeze_first``): every param frozen (``requires_grad_(False)``)
  through the model's first forward, which runs the implementation's lazy init, then unfrozen
  before the first step (a frozen warm-up, a frozen backbone's first pass); the frozen forward
  changes nothing, its loss is the reference's;
- ``first_grad_on_synced_microbatch`` and ``unit_skips_nosync_microbatches`` (``Config.late``): a
  head (module ``late``, after the body) run only on each step's last micro-batch, as an auxiliary
  head or a loss term computed once per accumulated batch: in the root's call its params get no grad
  on the held micro-batches and their first on the synced one; in a call of its own that call runs
  no forward on the held micro-batches. The ledger of all-gathers (``gathers.GatherLedger``) then
  knows nothing of that call's state on a held micro-batch: at most one gather of it;
- ``inplace_on_output_view`` (``Config.inplace_view``): every leaf returns a view of its output and
  the root scales the body's output in place (``mul_(1.0)``): where the body's last leaf is a sharded
  module, the view it returned is modified in place above it;
- ``stored_intermediate_loss`` (``Config.stored_loss``): every Linear leaf stores on itself, after
  its output, a term computed from its input and weight (``Leaf.stored``, as a router keeps its
  auxiliary loss), and the loss adds what this forward stored (``grammar.loss_of``): backward reaches
  the weight through that term too, not only through the module's output;
- ``optimizer_after_forward`` (``Config.optimizer_late``): the optimizers built after a first forward with
  no backward (a warm-up, a shape inference): where a call kept its params gathered then, the model's
  optimizer holds unsharded copies: the implementation trains right, or refuses the first step with a
  ``RuntimeError`` naming a param and the optimizer (ours), never steps the copies silently (FSDP2);
- ``list_module_called_again`` (``Config.calls_again``): after the body, a block (module ``mtp``,
  ``grammar.CallsHead``) calls the model's head (module ``head``, not its child) on its own output and
  stores the mean of what the head returned, as a multi-token-prediction block keeps its logits; the
  head then runs again on the body's output, and the loss adds the stored term. The two are sharded
  by one list call (the feature: independent groups for ours, one group for torch FSDP2), or, as
  controls, by calls of their own or the root's. The head runs twice a forward, so the ledger holds
  both modules loose (``_called_again``), reads their numels as the whole forward left them
  (``_forward_done``), keeps them out of prefetch lists and lets the head's call reduce twice.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.kit.explore.gathers import Unit
from tests.kit.explore.grammar import AGAIN, batch, clear_stored, loss_of
from tests.kit.judging.surface import impl


class Patterns:
    """Methods of ``Example`` (its attributes: config, ctx, model, reference, gathers, ...)."""

    config: Any
    ctx: Any
    model: Any
    reference: Any
    gathers: Any
    plans: Any
    loss_scale: Any
    tol: Any

    def _first_forward(self, frozen: bool) -> None:
        """A first forward (grad enabled) with no backward: ``freeze_through_lazy_init`` (``frozen``:
        every param frozen through it, then trainable again as drawn, frozen leaves staying frozen)
        or ``optimizer_after_forward``'s warm-up; its loss as promised; the ledger holds what it left
        gathered."""
        trainable = [path for path, p in self.model.named_parameters() if p.requires_grad]
        for param in self.model.parameters() if frozen else ():
            param.requires_grad_(False)
        args, kwargs = batch(self.config, 0, 0, self.ctx.rank)
        out = self.model(*args, **kwargs)
        with torch.no_grad():
            ref_out = self.reference.forward(args, kwargs)
        loss, ref_loss = loss_of(out, self.loss_scale), loss_of(ref_out, self.loss_scale)
        label = "the first forward, every param frozen: loss" if frozen else "a warm-up forward: loss"
        self.ctx.close(label, loss.detach().double(), ref_loss.double(), self.tol.loss)
        if frozen:
            needs = any(isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values()))
            self.ctx.equal(f"{label} needs a grad (as its inputs do)", loss.requires_grad, needs)
        self.gathers.after_forward(self._resharded_after_forward(), self._rows_gather)
        self.forward_without_backward = True  # the next backward's implicit prefetch order is ambiguous
        registered = dict(self.model.named_parameters())  # what the user reaches now (a gathered group's too)
        for path in trainable:
            registered[path].requires_grad_(True)

    def _note_copies_held(self, optimizer: Any) -> None:
        """``optimizer_after_forward``: the params the engine manages (not ignored) that the optimizer,
        built after the warm-up forward, holds as plain tensors (a call that kept its params gathered:
        a copy, not what trains)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        sharded = {path for path, plan in self.plans.items() if plan.kind != "ignored"}  # the engine's own
        named = self.model.named_parameters()
        self.copies_held = [p for p, prm in named if id(prm) in held and p in sharded and not impl.is_sharded(prm)]

    def _refused(self, model_step: Any) -> bool:
        """The model's optimizer step; where its optimizer holds unsharded copies, the implementation may
        refuse it (a ``RuntimeError`` naming one of their params and the optimizer: then True) or train
        right (the params after the step are judged as always)."""
        held, self.copies_held = getattr(self, "copies_held", []), []
        if not held:
            model_step()
            return False
        try:
            model_step()
        except RuntimeError as error:
            text, leaves = str(error), sorted({path.rpartition(".")[2] for path in held})
            named = "optimizer" in text and any(f"'{leaf}'" in text for leaf in leaves)
            label = f"an optimizer holding the unsharded copies of {held}: its step refused naming the param"
            self.ctx.true(label, named, text.splitlines()[0][:160] if text else "", f"one of {leaves}")
            return True
        return False

    def _called_again(self, sizes: dict[Unit, int]) -> dict[Unit, int]:
        """``list_module_called_again``: the units of the block and of the head it calls (the head runs
        twice a forward), each loose in the ledger: at most three times its whole call's gather in one
        forward or backward (once per call of the head, and once more by a prefetch: torch FSDP2's
        implicit one follows the forward's order, which lists the head twice; a list call may be one
        group, gathered whenever one of its modules starts; a gather from the rows an int
        reshard_after_forward keeps may take more than the shard)."""
        units = [unit for unit in self._units() if unit[1] in AGAIN]
        settings = self._resharded_after_forward()

        def most(unit: Unit) -> int:
            rows = settings[unit[0]]
            return max(sizes[unit], self._rows_gather(unit, rows)[1]) if type(rows) is int else sizes[unit]

        return {unit: 3 * sum(most(other) for other in units if other[0] == unit[0]) for unit in units}

    def _late_units(self) -> list[Unit]:
        """The units of the late head's own call (none where it is in the root's)."""
        return [(i, path) for i, group in enumerate(self.config.groups) for path in group.paths if path == "late"]

    def _late_switch(self, on: bool, starts: bool = False) -> None:
        """The late head run (``on``: a step's last micro-batch) or not, in both models; where it is not,
        its own call's state is unknown to the ledger (a prefetch may gather it, nothing else). The other
        calls' stay known: a list call's module that runs no forward is left as it was (``_idle_units``),
        the case that had made the ledger forget every call under prefetch.
        ``starts``: a micro-batch starts, what the leaves stored in earlier forwards dropped."""
        if starts:
            self._micro_done()
        if not self.config.late:
            return
        self.model.late_on = self.reference.compute.late_on = on
        units = self._late_units()
        if not units:
            return
        if not on:
            self.gathers.forget(units)

    def _forward_done(self, last: bool) -> None:
        """After a micro-batch's forward: the late head's call as ``_late_switch`` says; the modules called
        twice (loose units) as the whole forward left them, not as their last call did (a list call that
        is one group, torch FSDP2's, completes a forward its modules did not all run at the root's end)."""
        self._late_switch(last)
        for unit in self.gathers.loose:
            if unit in self.after_forward:
                self.after_forward[unit] = self._own_numels(*unit)

    def _micro_done(self) -> None:
        """What the leaves stored dropped (freed with the step's graph), the late head on again."""
        clear_stored(self.model)
        clear_stored(self.reference.compute)
        if self.config.late:
            self.model.late_on = self.reference.compute.late_on = True
