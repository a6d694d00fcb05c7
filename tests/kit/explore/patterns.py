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
  the weight through that term too, not only through the module's output.
"""

from __future__ import annotations

from typing import Any

import torch

from tests.kit.explore.gathers import Unit
from tests.kit.explore.grammar import batch, clear_stored, loss_of


class Patterns:
    """Methods of ``Example`` (its attributes: config, ctx, model, reference, gathers, ...)."""

    config: Any
    ctx: Any
    model: Any
    reference: Any
    gathers: Any
    loss_scale: Any
    tol: Any

    def _frozen_first_forward(self) -> None:
        """``freeze_through_lazy_init``: the first forward (with grad enabled) with every param frozen,
        its loss as promised, then the params trainable again as they were drawn (frozen leaves stay
        frozen); the ledger holds what it left gathered."""
        trainable = [path for path, p in self.model.named_parameters() if p.requires_grad]
        for param in self.model.parameters():
            param.requires_grad_(False)
        args, kwargs = batch(self.config, 0, 0, self.ctx.rank)
        out = self.model(*args, **kwargs)
        with torch.no_grad():
            ref_out = self.reference.forward(args, kwargs)
        loss, ref_loss = loss_of(out, self.loss_scale), loss_of(ref_out, self.loss_scale)
        label = "the first forward, every param frozen: loss"
        self.ctx.close(label, loss.detach().double(), ref_loss.double(), self.tol.loss)
        self.gathers.after_forward(self._resharded_after_forward(), self._rows_gather)
        self.forward_without_backward = True  # the next backward's implicit prefetch order is ambiguous
        registered = dict(self.model.named_parameters())  # what the user reaches now (a gathered group's too)
        for path in trainable:
            registered[path].requires_grad_(True)

    def _late_units(self) -> list[Unit]:
        """The units of the late head's own call (none where it is in the root's)."""
        return [(i, path) for i, group in enumerate(self.config.groups) for path in group.paths if path == "late"]

    def _late_switch(self, on: bool, starts: bool = False) -> None:
        """The late head run (``on``: a step's last micro-batch) or not, in both models; where it is not,
        its own call's state is unknown to the ledger (a prefetch may gather it, nothing else), and
        under prefetch lists, which name it, every call's, there and in the first forward running it
        again (L4 found ours gathering less than the ledger said then: 82e33e4040, not yet explained).
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
            self.late_skipped = True
            self.gathers.forget(self._units() if self.config.prefetch else units)
        elif starts and getattr(self, "late_skipped", False):
            self.late_skipped = False
            if self.config.prefetch:
                self.gathers.forget(self._units())

    def _micro_done(self) -> None:
        """What the leaves stored dropped (freed with the step's graph), the late head on again."""
        clear_stored(self.model)
        clear_stored(self.reference.compute)
        if self.config.late:
            self.model.late_on = self.reference.compute.late_on = True
