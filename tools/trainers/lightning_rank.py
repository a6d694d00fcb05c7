"""One rank of a Lightning run on the CPU (``python -m torch.distributed.run ... lightning_rank.py``).

Lightning's ``ModelParallelStrategy`` leaves sharding to the user's ``configure_model``, which calls
``fully_shard`` as torch's docs show, from ``torch.distributed.fsdp``: FSDP2's, or an
implementation's swapped in there (``tools.peer_suite.swap``). The model is the kit's L3 decoder,
each layer then the root sharded over the strategy's data-parallel mesh, trained with AdamW on each
rank's own seeded token batches. The rank ``TRAINER_RECORD_RANK`` writes each step's loss (its own)
and grad norm (over every param) at full precision, its time and peak RSS to ``TRAINER_RECORD``.

    lightning_rank.py --steps 5 [--bf16]     # --bf16: bf16 params, fp32 reduce (MixedPrecisionPolicy)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--bf16", action="store_true")
    args = parser.parse_args()
    sys.path.insert(0, os.environ["TRAINER_REPO"])
    spec = os.environ.get("TRAINER_IMPLEMENTATION", "torch")
    if spec != "torch":
        from tools.peer_suite.swap import install

        install(spec)
    train(args.steps, args.bf16, os.environ["TRAINER_RECORD"], int(os.environ.get("TRAINER_RECORD_RANK", "0")))


def train(steps: int, bf16: bool, record: str, record_rank: int) -> None:
    """``steps`` optimizer steps of the L3 decoder under Lightning's ModelParallelStrategy."""
    import pytorch_lightning as pl
    import torch
    import torch.distributed as dist
    from pytorch_lightning.strategies import ModelParallelStrategy

    from tests.kit.workloads.networks import LLM_SEQ, cross_entropy_loss, llm_decoder, token_batch

    class Batches(torch.utils.data.IterableDataset):
        """This rank's seeded token batches, one a step (ranks differ: data parallel)."""

        def __iter__(self):
            rank = dist.get_rank()
            for step in range(steps):
                yield token_batch(step, rank, 4, LLM_SEQ, 1024)

    class Decoder(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = llm_decoder()

        def configure_model(self) -> None:
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mesh = self.device_mesh["data_parallel"]
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
            kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy is not None else {})}
            for layer in self.model.layers:
                fully_shard(layer, **kwargs)
            fully_shard(self.model, **kwargs)

        def training_step(self, batch, index):
            tokens, targets = batch
            self.step_loss = cross_entropy_loss(self.model(tokens), targets)
            return self.step_loss

        def on_before_optimizer_step(self, optimizer) -> None:
            norm = torch.nn.utils.clip_grad_norm_(self.parameters(), float("inf"))
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
            if dist.get_rank() == record_rank:
                peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
                entry = {"step": self.global_step + 1, "loss": float(self.step_loss), "grad_norm": float(norm),
                         "time": time.perf_counter(), "rss_mib": peak}  # fmt: skip
                with open(record, "a") as f:
                    f.write(json.dumps(entry) + "\n")

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01)

    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=int(os.environ["WORLD_SIZE"]),
        strategy=ModelParallelStrategy(data_parallel_size=int(os.environ["WORLD_SIZE"]), tensor_parallel_size=1),
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(Decoder(), torch.utils.data.DataLoader(Batches(), batch_size=None))


if __name__ == "__main__":
    main()
