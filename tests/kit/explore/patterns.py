"""Usage patterns of torch FSDP2's users, as drawn options of L4's one grammar (a mixin of
``oracle.Example``; drawn by ``pattern_draws.patterns``, the model's part in ``grammar.Net``). Each composes
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
- ``ranks_skip_params`` (``Config.late_ranks``): the same head, in the root's call, run on some ranks only (a
  routed expert, a conditional branch): on the others its params get no grad while the root's own do, and the
  promise is DDP(find_unused_parameters=True)'s: their zeros in the mean (the reference's ``zeros_for``);
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
  (``_forward_done``), keeps them out of prefetch lists and lets the head's call reduce twice;
- ``freeze_across_steps`` (``Step.toggle``): before a step, a module's params flipped between frozen and
  trainable in both models (``_toggle``), as a user freezes a backbone for some steps or unfreezes one
  frozen from the start (lazy init then saw it frozen): frozen, a param gets no grad and keeps its value;
  trainable again, it trains as the reference does;
- ``two_forwards_one_backward`` (``Config.forwards``): a forward of another batch before each micro-batch's
  own (``_first_of_two``), the loss the sum of both, one backward: every unit loose in the ledger
  (``_called_again``), each call may reduce once per forward's graph;
- argument spellings: ``set_reduce_op_type`` given ``"SUM"`` or ``"Avg"`` (``_reduce_op``), which the
  implementation takes as the lower case or refuses with a ``ValueError`` naming the argument and value;
- ``state_dict_before_forward`` (``Config.early_state_dict``): ``model.state_dict()`` taken before the first
  forward and read after training (``_check_early_state_dict``): it holds the trained params, as a plain
  model's does;
- ``tied_params_split_groups`` (``Group.split_tie``): a tied pair's halves in two calls, refused naming the
  weight at a call or a first forward (``_refused_split_tie``), or trained as one tied param.
Two more live where they act: ``state_dict_assign`` (``setups.SetUps._assign_sharded_state``) and
``grad_dtype`` (``promised.bf16_with_fp32_grads``, for both models).
"""

from __future__ import annotations

from typing import Any

import torch

from tests.kit.explore.gathers import Unit
from tests.kit.explore.grammar import AGAIN, batch, clear_stored, loss_of
from tests.kit.judging.surface import impl

OTHER_BATCH = 1000  # the first of two forwards takes the batch of this micro-batch index plus it


class Patterns:
    """Methods of ``Example`` (its attributes: config, ctx, model, reference, gathers, ...)."""

    config: Any
    ctx: Any
    model: Any
    reference: Any
    gathers: Any
    plans: Any
    hsdp_modules: Any
    loss_scale: Any
    tol: Any

    def _refused_split_tie(self, action: Any) -> bool:
        """``tied_params_split_groups``: ``action`` (the calls, or a first forward) may refuse the weight two
        calls share, by a ``ValueError`` or ``RuntimeError`` naming it (then True: nothing more to judge; FSDP2
        2.13 and ours refuse at the first forward); where nothing refuses, training is judged as always (the
        reference trains one tied weight)."""
        if not self._split_tie:
            action()
            return False
        try:
            action()
        except (ValueError, RuntimeError) as error:
            text = str(error)
            label = "a weight two fully_shard calls share (a tied pair split): refused naming it"
            self.ctx.true(label, "weight" in text, text.splitlines()[0][:160] if text else "", "the weight named")
            return True
        return False

    def _before_training(self) -> tuple[Any, Any] | None:
        """The optimizers of the model and the reference, built after a first forward where drawn
        (``freeze_through_lazy_init``, ``optimizer_after_forward``); before them, the model's state dict kept
        where drawn (``state_dict_before_forward``). A split tie's first forward comes after the optimizers
        (which then hold the shards): None where it refused the weight (``tied_params_split_groups``)."""
        self.early_state = self.model.state_dict() if self.config.early_state_dict else {}
        if not self.config.optimizer_late:
            opts = self._optimizer(self.model.parameters()), self._optimizer(self.reference.master.parameters())
        if self._refused_split_tie(lambda: self._first_forward(frozen=False) if self._split_tie else None):
            return None
        if self.config.freeze_first or self.config.optimizer_late:
            self._first_forward(frozen=self.config.freeze_first)
        if self.config.optimizer_late:
            opts = self._optimizer(self.model.parameters()), self._optimizer(self.reference.master.parameters())
            self._note_copies_held(opts[0])
        return opts

    @property
    def _split_tie(self) -> bool:
        return any(group.split_tie for group in self.config.groups)

    def _check_early_state_dict(self) -> None:
        """``state_dict_before_forward``: after training, each param's tensor in the state dict taken before the
        first forward holds what this rank's param holds now (a plain model's state dict shares its params'
        storage, so a user who saves it later saves the trained weights)."""
        params = dict(self.model.named_parameters())
        for key, early in self.early_state.items():
            if key not in params:
                continue  # a buffer: never trained
            now, then = impl.local(params[key]), impl.local(early)
            label = f"state_dict() taken before the first forward, read after training: {key} = the trained param"
            same = then.dtype == now.dtype and then.shape == now.shape and torch.equal(then, now)
            self.ctx.true(label, same, f"{tuple(then.shape)} {then.dtype}", f"{tuple(now.shape)} {now.dtype}")

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
        built after the warm-up forward, holds as they were registered then; ``_refused`` counts those the
        model no longer registers at the step as copies, not what trains (a call that kept its params
        gathered: unsharded copies; an int ``reshard_after_forward``: the rows it kept)."""
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        sharded = {path for path, plan in self.plans.items() if plan.kind != "ignored"}  # the engine's own
        named = self.model.named_parameters()
        self.held_at_build = [(p, prm) for p, prm in named if id(prm) in held and p in sharded]

    def _copies_held(self) -> list[str]:
        """The params the optimizer built after the warm-up holds that the model no longer registers."""
        held, self.held_at_build = getattr(self, "held_at_build", []), []
        registered = dict(self.model.named_parameters())
        return [path for path, param in held if registered[path] is not param]

    def _refused(self, model_step: Any) -> bool:
        """The model's optimizer step; where its optimizer holds copies (``_copies_held``), the implementation may
        refuse it (a ``RuntimeError`` naming one of their params and the optimizer: then True) or train
        right (the params after the step are judged as always)."""
        held = self._copies_held()
        if not held:
            model_step()
            return False
        try:
            model_step()
        except RuntimeError as error:
            text, leaves = str(error), sorted({path.rpartition(".")[2] for path in held})
            named = "optimizer" in text and any(f"'{leaf}'" in text for leaf in leaves)
            label = f"an optimizer holding copies of {held} the model no longer registers: its step refused naming one"
            self.ctx.true(label, named, text.splitlines()[0][:160] if text else "", f"one of {leaves}")
            return True
        return False

    def _toggle(self, path: str) -> None:
        """``freeze_across_steps``: the params of module ``path`` (as registered now: the shards, or a
        gathered call's unsharded params) flipped between frozen and trainable before a step, in the model
        under test and in the reference, as a user freezes a backbone for some steps or unfreezes it
        progressively; the plans follow, for what the reductions carry."""
        if not path:
            return
        for model in (self.model, self.reference.compute, self.reference.master):
            for param in model.get_submodule(path).parameters(recurse=False):
                param.requires_grad_(not param.requires_grad)
        if any(p.requires_grad for p in self.model.get_submodule(path).parameters(recurse=False)):
            self.held_at_first_end = None  # a param trainable anew may get its state once: counted from this step's end
        masters = dict(self.reference.master.named_parameters())
        for plan in self.plans.values():
            plan.trainable = masters[plan.path].requires_grad

    def _reduce_op(self, written: str, group: int | None) -> None:
        """``set_reduce_op_type`` as the step writes it, on the root (recursing) or on call ``group`` alone: a
        spelling users write (``"SUM"``, ``"Avg"``) means its lower case, or is refused by a ``ValueError``
        naming the argument and the value (then set in lower case, as the user fixes it)."""
        op, kwargs = written.lower(), {} if group is None else {"recurse": False}
        for module in [self.hsdp_modules[-1][0]] if group is None else self.hsdp_modules[group]:
            try:
                module.set_reduce_op_type(written, **kwargs)
            except ValueError as error:
                if written == op:
                    raise
                text = str(error)
                named = "reduce_op_type" in text or "reduce op type" in text.lower()
                label = f"set_reduce_op_type({written!r}) refused naming the argument and the value"
                self.ctx.true(label, named and written in text, text.splitlines()[0][:160] if text else "")
                module.set_reduce_op_type(op, **kwargs)
        if group is None:
            self.reference.ops = [op] * len(self.reference.ops)
        else:
            self.reference.ops[group] = op

    def _called_twice(self) -> set[Unit]:
        """The units of ``list_module_called_again``'s block and head (the head runs twice a forward)."""
        return {unit for unit in self._units() if self.config.calls_again and unit[1] in AGAIN}

    def _called_again(self, sizes: dict[Unit, int]) -> dict[Unit, int]:
        """The units a forward (or the forwards before one backward) runs more than once, each loose in the
        ledger: ``list_module_called_again``'s block and head, and with ``two_forwards_one_backward`` every
        unit. Each gathers at most its whole call's gather once per run and once more for a prefetch, in
        one forward phase or one backward (twice that under activation checkpointing: ``GatherLedger``);
        torch FSDP2's implicit prefetch follows the forward's order, which lists a unit run twice twice; a
        list call may be one group, gathered whenever one of its modules starts; a gather from the rows an
        int reshard_after_forward keeps may take more than the shard."""
        twice = self._called_twice()
        units = self._units() if self.config.forwards > 1 else sorted(twice)
        settings = self._resharded_after_forward()

        def most(unit: Unit) -> int:
            rows = settings[unit[0]]
            return max(sizes[unit], self._rows_gather(unit, rows)[1]) if type(rows) is int else sizes[unit]

        def runs(unit: Unit) -> int:
            return self.config.forwards * (2 if unit in twice else 1)

        return {unit: (runs(unit) + 1) * sum(most(other) for other in units if other[0] == unit[0]) for unit in units}

    def _first_of_two(self, step: Any, step_index: int, micro: int, where: str) -> tuple[Any, Any] | None:
        """``two_forwards_one_backward``: a forward of another batch before the micro-batch's own (DPO's
        chosen before its rejected): its loss term (with what its leaves stored, read before the next
        forward stores afresh) for the one backward, and its collectives; None with one forward."""
        if self.config.forwards < 2:
            return None
        args, kwargs = batch(self.config, step_index, micro + OTHER_BATCH, self.ctx.rank)
        out, rec = self._forward(step, args, kwargs, f"{where} first forward")
        return loss_of(out, self.loss_scale, self.model), rec

    def _reference_first(self, step: Any, step_index: int, micro: int) -> Any:
        """The reference's loss term of ``_first_of_two``'s forward (0 with one forward a backward)."""
        if self.config.forwards < 2:
            return 0.0
        args, kwargs = batch(self.config, step_index, micro + OTHER_BATCH, self.ctx.rank)
        return loss_of(self.reference.forward(args, kwargs, step.method), self.loss_scale, self.reference.compute)

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
        if not self.config.has_late:
            return
        ran = on or not self.config.late  # somewhere: a head run on the last micro-batch only, or on each
        here = ran and (not self.config.late_ranks or self.ctx.rank in self.config.late_ranks)
        self.model.late_on = self.reference.compute.late_on = here
        late = [path for path in self.plans if path.startswith("late.")]
        self.reference.zeros_for = set(late) if ran and not here else set()  # DDP's unused params: zeros
        units = self._late_units()
        if units and not ran:
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
        if self.config.has_late:
            self.model.late_on = self.reference.compute.late_on = True
            self.reference.zeros_for = set()
