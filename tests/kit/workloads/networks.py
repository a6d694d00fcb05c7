"""The plan's language networks (L2/L3), written once: decoder LLMs (dense, MoE, chunked CE), their
losses and seeded token data. Blocks: ``tests.kit.workloads.blocks``; experts and their dispatch:
``tests.kit.workloads.moe``; the ViT and the multimodal stack: ``tests.kit.workloads.vision``.

Every model is built from a seed (``torch.manual_seed`` inside the constructor, as in models.py), in
fp32 on the CPU; move it with ``.to(device)``. Presets (the plan's L3 rows, docs/cases.md):

- ``llm_decoder()``: L3-01/02, 4 layers, vocab 1024, hidden 256 (data: seq ``LLM_SEQ``).
- ``moe_decoder()``: L3-03 (and L2-10), layers 1 and 3 MoE with 4 experts, top-2, expert dim 2 x hidden.
- ``chunked_ce_decoder()``: L3-05, 2 layers, vocab 32768; ``Decoder.forward(tokens, targets)`` gives the
  chunked cross entropy (``chunked_cross_entropy``: fp32 per token, summed in float64) computed inside forward,
  where sharded params are whole; ``whole_loss=True`` adds the CE of the whole logits, computed apart.
- ``vit()``: L3-04; ``Multimodal(seed)``: L3-06 (ViT -> projector -> decoder, with DeepStack).

Under ``fully_shard`` a module's params are whole only inside its ``forward``, so every use a case needs
goes through a forward: ``Decoder.forward`` takes the loss targets, visual prefix and DeepStack injection;
``ViT.forward`` can return tapped block outputs.

Expert parallelism: ``split_experts(model, group, ep_size, ep_rank)`` keeps each rank's slice of every
MoE's experts and switches its dispatch to all-to-all over ``group``; ``expert_name_map`` maps the
local parameter names back to the full model's, for comparing against a single-device reference.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.kit.workloads.blocks import DecoderBlock, RMSNorm, SwiGLU
from tests.kit.workloads.moe import MoE, expert_name_map, expert_params, moe_modules, split_experts

__all__ = [
    "CE_CHUNK",
    "ChunkedLoss",
    "LLM_SEQ",
    "MOE_SEQ",
    "Decoder",
    "DecoderConfig",
    "chunked_ce_decoder",
    "chunked_cross_entropy",
    "cross_entropy_loss",
    "expert_name_map",
    "expert_params",
    "global_token_batch",
    "llm_decoder",
    "moe_decoder",
    "moe_modules",
    "param_count",
    "seeded_generator",
    "split_experts",
    "summed_cross_entropy",
    "token_batch",
    "whole_cross_entropy",
]

LLM_SEQ = 128  # sequence length of L3-01/02 data
MOE_SEQ = 64  # sequence length of L3-03 data
CE_CHUNK = 512  # tokens per chunk of L3-05's cross entropy

# --------------------------------------------------------------------------------------
# Losses


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum of the tokens' cross entropies (divide by a global token count for a global mean)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all tokens of [..., V] logits (the unchunked reference)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# Each token's cross entropy is computed in fp32; the mean over the tokens is summed in float64.
# The plan's 1e-6 between the sum of the chunk losses and the whole loss is one ulp of an fp32 loss
# of 10 (9.5e-7), which two fp32 sums of 544 terms in different orders cannot promise; summed in
# float64 they agree to ~1e-15 unless the chunking itself is wrong (a chunk dropped, or divided by
# its own length).
SUM_DTYPE = torch.float64


def _token_losses(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Each token's cross entropy (fp32 logits [N, V], targets [N]), in float64 for the sum."""
    picked = logits.gather(1, targets.unsqueeze(1)).squeeze(1)
    return torch.logsumexp(logits, dim=1).to(SUM_DTYPE) - picked.to(SUM_DTYPE)


class ChunkedLoss(NamedTuple):
    """What the chunked cross entropy returns."""

    total: torch.Tensor  # the chunk losses added in order: what backward runs through
    chunks: list[torch.Tensor]  # each chunk's summed CE over the total token count
    whole: torch.Tensor | None  # the mean CE of all the logits at once, computed apart (no grad), if asked


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, total: int) -> torch.Tensor:
    """Summed CE of one chunk divided by the total token count (chunk losses add up to the mean)."""
    return _token_losses(hidden @ weight.t(), targets).sum() / total


def whole_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean CE of ``hidden [N, H] @ weight[V, H].T`` at once, without grad: the loss chunking must keep."""
    with torch.no_grad():
        return _token_losses(hidden @ weight.t(), targets).mean()


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = CE_CHUNK, whole: bool = False
) -> ChunkedLoss:
    """Mean CE of ``hidden [N, H] @ weight[V, H].T`` against ``targets [N]``, ``chunk`` tokens at a time.

    Each chunk runs under non-reentrant checkpoint, so its [chunk, V] logits are recomputed in backward
    instead of kept. ``total`` is the per-chunk losses added in order; with ``whole`` the CE of the whole
    logits is computed apart too (``whole_cross_entropy``), to check the chunks against.
    """
    n = hidden.shape[0]
    losses = [
        checkpoint(_chunk_loss, h, weight, t, n, use_reentrant=False)
        for h, t in zip(hidden.split(chunk), targets.split(chunk), strict=True)
    ]
    witness = whole_cross_entropy(hidden, weight, targets) if whole else None
    return ChunkedLoss(sum(losses[1:], losses[0]), losses, witness)


# --------------------------------------------------------------------------------------
# Decoder LLM


@dataclass(frozen=True)
class DecoderConfig:
    """Sizes of a ``Decoder``; layers listed in ``moe_layers`` get an MoE FFN instead of SwiGLU."""

    vocab: int = 1024
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    ffn_inner: int = 768
    moe_layers: tuple[int, ...] = ()
    experts: int = 4
    top_k: int = 2
    expert_inner: int = 512
    seed: int = 0


Injection = Mapping[int, tuple[slice, torch.Tensor]]


class Decoder(nn.Module):
    """Embedding -> pre-norm decoder blocks -> RMSNorm -> output head tied to the embedding weight."""

    def __init__(self, config: DecoderConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or DecoderConfig()
        torch.manual_seed(c.seed)
        self.embed = nn.Embedding(c.vocab, c.hidden)
        nn.init.normal_(self.embed.weight, std=0.02)  # tied head: small logits, loss near log(vocab)
        self.layers = nn.ModuleList(DecoderBlock(c.hidden, c.heads, self._ffn(i)) for i in range(c.layers))
        self.norm = RMSNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab, bias=False, device="meta")  # weight replaced: no init, no RNG
        self.head.weight = self.embed.weight

    def _ffn(self, index: int) -> nn.Module:
        """Layer ``index``'s FFN: MoE when listed in ``moe_layers``, else SwiGLU."""
        c = self.config
        if index in c.moe_layers:
            return MoE(c.hidden, c.experts, c.top_k, c.expert_inner)
        return SwiGLU(c.hidden, c.ffn_inner)

    def forward_embeddings(self, x: torch.Tensor, inject: Injection | None = None) -> torch.Tensor:
        """Run the blocks and final norm on embeddings [B, S, H]; ``inject[i] = (positions, t)`` adds ``t``
        to the hidden states at those sequence positions right after block ``i`` (DeepStack)."""
        inject = inject or {}
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i in inject:
                positions, extra = inject[i]
                delta = x.new_zeros(x.shape)
                delta[:, positions] = extra
                x = x + delta
        return self.norm(x)

    def hidden_states(
        self, tokens: torch.Tensor, prefix: torch.Tensor | None = None, inject: Injection | None = None
    ) -> torch.Tensor:
        """Final normed hidden states [B, S, H] of the token positions; ``prefix`` [B, P, H] (embeddings put
        before the tokens) and ``inject`` (positions counted from the prefix's start) as in ``forward``."""
        x = self.embed(tokens)
        if prefix is not None:
            x = torch.cat([prefix, x], dim=1)
        hidden = self.forward_embeddings(x, inject)
        return hidden if prefix is None else hidden[:, prefix.shape[1] :]

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        *,
        prefix: torch.Tensor | None = None,
        inject: Injection | None = None,
        ce_chunk: int = CE_CHUNK,
        whole_loss: bool = False,
    ) -> torch.Tensor | ChunkedLoss:
        """Logits [B, S, vocab] of tokens [B, S]; with ``targets`` instead the chunked CE (``ChunkedLoss``;
        ``whole_loss``: with the CE of the whole logits computed apart).

        Everything runs inside forward (the loss too), because a ``fully_shard``-ed module's params are
        whole only there: call the other methods directly only on unsharded models. ``prefix``: embeddings
        [B, P, H] prepended to the token embeddings (visual tokens), not in the output. ``inject``: see
        ``forward_embeddings``.
        """
        hidden = self.hidden_states(tokens, prefix, inject)
        if targets is None:
            return self.head(hidden)
        return chunked_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), self.head.weight, targets.reshape(-1), ce_chunk, whole_loss
        )


def llm_decoder(seed: int = 0) -> Decoder:
    """L3-01/02: 4 dense layers, vocab 1024, hidden 256 (data seq ``LLM_SEQ``)."""
    return Decoder(DecoderConfig(seed=seed))


def moe_decoder(seed: int = 0) -> Decoder:
    """L3-03: 4 layers, 1 and 3 MoE (4 experts, top-2, expert dim 512 = 2 x hidden), hidden 256 (seq ``MOE_SEQ``)."""
    return Decoder(DecoderConfig(moe_layers=(1, 3), experts=4, top_k=2, expert_inner=512, seed=seed))


def chunked_ce_decoder(seed: int = 0) -> Decoder:
    """L3-05: 2 layers, vocab 32768, hidden 256; loss by ``forward(tokens, targets)`` in chunks of 512."""
    return Decoder(DecoderConfig(vocab=32768, layers=2, seed=seed))


# --------------------------------------------------------------------------------------
# Seeded data


def seeded_generator(seed: int, step: int, rank: int) -> torch.Generator:
    """A generator that differs per rank and per step and is reproducible anywhere."""
    return torch.Generator().manual_seed(seed + 7919 * step + rank)


def token_batch(
    step: int, rank: int, batch: int, seq: int, vocab: int, seed: int = 3000
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, S], targets [B, S]) where targets are the next tokens of one drawn sequence."""
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=seeded_generator(seed, step, rank))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def global_token_batch(
    step: int, rank: int, world: int, batch: int, seq: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (tokens, targets) and every rank's concatenated, in rank order (the global batch a
    single-device baseline trains on)."""
    every = [token_batch(step, r, batch, seq, vocab) for r in range(world)]
    tokens, targets = every[rank]
    return tokens, targets, torch.cat([t for t, _ in every]), torch.cat([t for _, t in every])


def param_count(module: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in module.parameters())
