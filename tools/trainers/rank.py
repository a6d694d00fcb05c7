"""One rank of a torchtitan run on the CPU (``python -m torch.distributed.run ... rank.py ARGS``).

Before torchtitan is imported: what the CPU and the installed torch lack (``SHIMS``, the same for
every implementation, none of them about FSDP), torch FSDP2's own need on gloo (its divide factor is
NCCL's PREMUL_SUM: ``set_force_sum_reduction_for_comms(True)`` beside it), and, for another
implementation, FSDP2's public names swapped for its own (``tools.peer_suite.swap``). The rank
``TRAINER_RECORD_RANK`` (torchtitan's metrics rank) writes each step's loss and grad norm, at full
precision, its time and peak RSS to ``TRAINER_RECORD`` (a JSON line a step).
"""

from __future__ import annotations

import json
import os
import sys
import types

SHIMS = (
    "device: torch._utils._get_available_device_type() answers 'cpu' (torchtitan falls back to 'cuda')",
    "metrics: torch.cpu gets get_device_name, get_device_properties (the host's memory), "
    "reset_peak_memory_stats, empty_cache and memory_stats (empty)",
    "torch.distributed.set_timeout (absent in torch 2.13): a no-op",
    "torch.distributed.barrier: device_ids dropped (gloo takes none)",
    "pipelining: a schedule's step given its microbatches ready cut (arg_mbs, kwarg_mbs, target_mbs, as "
    "torchtitan calls it) runs them as torch 2.13's step runs the cuts it makes of a whole batch",
    "attention: flex attention's call made SDPA with the block mask made dense (torch refuses flex "
    "attention's backward on the CPU, compiled or eager)",
)


def apply_shims() -> None:
    """What the CPU and torch 2.13 lack, given before torchtitan is imported."""
    import psutil
    import torch
    import torch._utils
    import torch.distributed as dist

    torch._utils._get_available_device_type = lambda: "cpu"
    torch.cpu.get_device_name = lambda *a, **k: "cpu"
    torch.cpu.get_device_properties = lambda *a, **k: types.SimpleNamespace(total_memory=psutil.virtual_memory().total)
    torch.cpu.reset_peak_memory_stats = lambda *a, **k: None
    torch.cpu.empty_cache = lambda *a, **k: None
    torch.cpu.memory_stats = lambda *a, **k: {}
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = lambda *a, **k: None
    barrier = dist.barrier

    def barrier_without_device_ids(*args, device_ids=None, **kwargs):
        return barrier(*args, **kwargs)

    dist.barrier = barrier_without_device_ids
    import torchtitan.models.common.attention as attention

    attention.FlexAttention._compiled_flex_attn = masked_sdpa
    microbatch_lists_for_pipelining()


def microbatch_lists_for_pipelining() -> None:
    """torchtitan hands a pipeline schedule's ``step`` its microbatches ready cut; torch 2.13's
    ``step`` takes the whole batch and cuts it, so the lists would reach the model as keyword
    arguments. Given lists, the schedule runs them as its ``step`` runs its own cuts."""
    import inspect

    from torch.distributed.pipelining import schedules

    for schedule in (schedules.PipelineScheduleSingle, schedules.PipelineScheduleMulti):
        if "arg_mbs" not in inspect.signature(schedule.step).parameters:
            schedule.step = _step_taking_microbatches(schedule.step)


def _step_taking_microbatches(step):
    def step_with_lists(self, *args, arg_mbs=None, kwarg_mbs=None, target_mbs=None, losses=None,
                        return_outputs=True, loss_kwargs=None, **kwargs):  # fmt: skip
        if arg_mbs is None and kwarg_mbs is None and target_mbs is None:
            return step(self, *args, losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs, **kwargs)
        stages = getattr(self, "_stages", None) or [self._stage]
        for stage in stages:  # what torch's step does before it runs the microbatches
            stage.has_backward = self._has_backward
            stage.clear_runtime_states()
        self._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, losses, return_outputs, loss_kwargs=loss_kwargs)
        last = [stage for stage in stages if stage.is_last]
        return self._merge_outputs(last[0].output_chunks) if last and return_outputs else None

    return step_with_lists


def masked_sdpa(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False, **_):
    """flex attention's result through SDPA, its block mask made dense (no score_mod here)."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import create_mask

    if score_mod is not None:
        raise NotImplementedError("a flex attention score_mod has no SDPA form in this launcher")
    mask = None
    if block_mask is not None:
        mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
    return out, types.SimpleNamespace(lse=None)


def force_sum_for_fsdp2() -> None:
    """torch FSDP2 on gloo: a divide factor asks NCCL's PREMUL_SUM, which gloo lacks; force-sum
    reductions make it SUM, then divide (its documented way)."""
    from torch.distributed.fsdp import FSDPModule

    divide = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor):
        divide(self, factor)
        self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


STEP_RECORDERS: list = []  # the recorder of the train step under way (count_collectives), if any


def count_collectives() -> None:
    """Each train step's collectives on this rank, counted by the kit's recorder up to the step's
    metrics (a dispatch mode: the steps run slower, alike for every engine)."""
    from torchtitan.trainer import Trainer

    from tests.kit.judging.recorder import record_collectives

    train_step = Trainer.train_step

    def counted(self, *args, **kwargs):
        with record_collectives() as recorder:
            STEP_RECORDERS[:] = [recorder]
            try:
                return train_step(self, *args, **kwargs)
            finally:
                STEP_RECORDERS.clear()

    Trainer.train_step = counted


def record_steps(path: str) -> None:
    """The recording rank writes each logged step's loss and grad norm to ``path`` at full precision, with the
    time it was logged and its peak resident memory so far (MiB), and each validation's loss."""
    import resource
    import time

    import torch.distributed as dist
    from torchtitan.components.metrics import MetricsProcessor

    log = MetricsProcessor.log

    def log_and_record(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs):
        if not dist.is_initialized() or dist.get_rank() == int(os.environ.get("TRAINER_RECORD_RANK", "0")):
            with open(path, "a") as f:
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                record = {"step": step, "loss": float(global_avg_loss), "grad_norm": float(grad_norm),
                          "time": time.perf_counter(), "rss_mib": peak}  # fmt: skip
                if STEP_RECORDERS:  # the step's collectives so far: all but the metrics' own
                    record["collectives"] = dict(sorted(STEP_RECORDERS[0].counts().items()))
                f.write(json.dumps(record) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, *args, **kwargs)

    MetricsProcessor.log = log_and_record
    log_validation = MetricsProcessor.log_validation

    def log_validation_and_record(self, loss, step, *args, **kwargs):
        if not dist.is_initialized() or dist.get_rank() == int(os.environ.get("TRAINER_RECORD_RANK", "0")):
            with open(path, "a") as f:
                f.write(json.dumps({"validation_at": step, "loss": float(loss)}) + "\n")
        return log_validation(self, loss, step, *args, **kwargs)

    MetricsProcessor.log_validation = log_validation_and_record


def main() -> None:
    spec = os.environ.get("TRAINER_IMPLEMENTATION", "torch")
    sys.path.insert(0, os.environ["TRAINER_REPO"])
    apply_shims()
    if spec == "torch":
        force_sum_for_fsdp2()
    else:
        from tools.peer_suite.swap import install

        install(spec)
    if os.environ.get("TRAINER_COLLECTIVES"):
        count_collectives()
    record_steps(os.environ["TRAINER_RECORD"])
    from torchtitan.train import main as train

    train()


if __name__ == "__main__":
    main()
