"""The plan's real networks (L2/L3), written once: decoder LLMs (dense, MoE, chunked CE), ViT, multimodal.

Every model is built from a seed (``torch.manual_seed`` inside the constructor, as in models.py), in
fp32 on the CPU; move it with ``.to(device)``. Presets (the plan's L3 rows, docs/cases.md):

- ``llm_decoder()``: L3-01/02, 4 layers, vocab 1024, hidden 256 (data: seq ``LLM_SEQ``).
- ``moe_decoder()``: L3-03 (and L2-10), layers 1 and 3 MoE with 4 experts, top-2, expert dim 2 x hidden.
- ``chunked_ce_decoder()``: L3-05, 2 layers, vocab 32768; ``Decoder.forward(tokens, targets)`` gives the
  chunked cross entropy (``chunked_cross_entropy``) computed inside forward, where sharded params are whole.
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

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

LLM_SEQ = 128  # sequence length of L3-01/02 data
MOE_SEQ = 64  # sequence length of L3-03 data
CE_CHUNK = 512  # tokens per chunk of L3-05's cross entropy

# --------------------------------------------------------------------------------------
# Building blocks


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim (learned weight, no bias)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, causal: bool) -> torch.Tensor:
    """Multi-head scaled dot-product attention of [B, S, H] projections; returns [B, S, H]."""
    b, s, h = q.shape

    def split(t: torch.Tensor) -> torch.Tensor:
        return t.view(b, s, heads, h // heads).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=causal)
    return out.transpose(1, 2).reshape(b, s, h)


def _check_heads(hidden: int, heads: int) -> None:
    """Heads must divide the hidden size."""
    if hidden % heads:
        raise ValueError(f"heads={heads} does not divide hidden={hidden}")


class CausalSelfAttention(nn.Module):
    """Decoder attention: separate q, k, v, o projections without bias, causal mask."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        _check_heads(hidden, heads)
        self.heads = heads
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.k = nn.Linear(hidden, hidden, bias=False)
        self.v = nn.Linear(hidden, hidden, bias=False)
        self.o = nn.Linear(hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.o(_attend(self.q(x), self.k(x), self.v(x), self.heads, causal=True))


class SelfAttention(nn.Module):
    """Encoder (ViT) attention: one fused ``qkv`` projection with bias, ``proj`` out, no mask."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        _check_heads(hidden, heads)
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.proj(_attend(q, k, v, self.heads, causal=False))


class SwiGLU(nn.Module):
    """``w_down(silu(w_gate(x)) * w_up(x))``, no biases: the decoder FFN and each MoE expert."""

    def __init__(self, hidden: int, inner: int) -> None:
        super().__init__()
        self.w_gate = nn.Linear(hidden, inner, bias=False)
        self.w_up = nn.Linear(hidden, inner, bias=False)
        self.w_down = nn.Linear(inner, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class GeluMLP(nn.Module):
    """``fc2(gelu(fc1(x)))``: the ViT block MLP and the multimodal projector."""

    def __init__(self, dim_in: int, inner: int, dim_out: int | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim_in, inner)
        self.fc2 = nn.Linear(inner, dim_out or dim_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


# --------------------------------------------------------------------------------------
# Mixture of experts and its dispatch (local or expert parallel)


def run_experts(experts: nn.ModuleList, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Rows grouped by expert (``counts[j]`` rows for ``experts[j]``, in order) -> each row's expert output.

    Every expert runs, on zero rows too, so every expert param gets a grad (zeros when unused) and the
    autograd graph always connects the output to ``rows`` (an expert-parallel backward never skips a rank).
    """
    chunks = rows.split(counts)
    return torch.cat([expert(chunk) for expert, chunk in zip(experts, chunks, strict=True)])


class LocalDispatch:
    """All experts live in this module: run them on the rows directly."""

    def __call__(self, moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert id, ``counts`` per global expert -> expert outputs in the same order."""
        if len(moe.experts) != moe.num_experts:
            raise RuntimeError(f"local dispatch needs all {moe.num_experts} experts, this MoE holds {moe.expert_ids}")
        return run_experts(moe.experts, rows, counts.tolist())


class ExpertParallelDispatch:
    """Experts split over ``group`` (rank r holds experts r*E/n .. (r+1)*E/n - 1): rows travel to their
    expert's owner by a differentiable all-to-all, are computed there and come back by the reverse one."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int) -> None:
        self.group, self.size, self.rank = group, size, rank

    def __deepcopy__(self, memo: dict) -> ExpertParallelDispatch:
        """Copies of a split model share the process group (a ProcessGroup cannot be copied)."""
        return self

    def __call__(self, moe: MoE, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by global expert id, ``counts`` per global expert -> expert outputs in the same order."""
        per_rank = moe.num_experts // self.size
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=self.group)  # [source rank, my local expert]
        recv_counts = recv_counts.view(self.size, per_rank)
        send_splits = counts.view(self.size, per_rank).sum(1).tolist()
        recv_splits = recv_counts.sum(1).tolist()
        received = dist_fn.all_to_all_single(
            rows.new_empty(sum(recv_splits), rows.shape[1]), rows, recv_splits, send_splits, group=self.group
        )
        results = self._compute(moe, received, recv_counts)
        return dist_fn.all_to_all_single(
            rows.new_empty(rows.shape), results, send_splits, recv_splits, group=self.group
        )

    def _compute(self, moe: MoE, received: torch.Tensor, recv_counts: torch.Tensor) -> torch.Tensor:
        """Received rows come as [source][local expert] blocks: regroup by expert, run, restore the order."""
        sizes = recv_counts.tolist()  # sizes[s][j]: rows from source s for local expert j
        blocks = received.split([n for row in sizes for n in row])
        sources, per_rank = len(sizes), len(sizes[0])
        by_expert = [blocks[s * per_rank + j] for j in range(per_rank) for s in range(sources)]
        per_expert = [sum(sizes[s][j] for s in range(sources)) for j in range(per_rank)]
        out = run_experts(moe.experts, torch.cat(by_expert), per_expert)
        out_blocks = out.split([sizes[s][j] for j in range(per_rank) for s in range(sources)])
        return torch.cat([out_blocks[j * sources + s] for s in range(sources) for j in range(per_rank)])


class MoE(nn.Module):
    """Top-k routed SwiGLU experts; softmax router in fp32, the k weights renormalised to sum 1;
    output = sum over the k slots of weight * expert(x).

    ``expert_ids``: global ids of the experts held (all, until ``split_experts``). ``dispatch`` gets the
    routed rows sorted by global expert id and returns each row's expert output (``LocalDispatch`` or
    ``ExpertParallelDispatch``). ``tokens_per_expert``: this rank's assignments per global expert in the
    last forward (uneven by nature).
    """

    def __init__(self, hidden: int, experts: int, top_k: int, inner: int) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k} not in 1..experts={experts}")
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(hidden, inner) for _ in range(experts))
        self.expert_ids: list[int] = list(range(experts))
        self.dispatch: LocalDispatch | ExpertParallelDispatch = LocalDispatch()
        self.tokens_per_expert: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] -> (weights [T, k] in x's dtype, summing to 1; chosen expert ids [T, k])."""
        probs = self.router(x).float().softmax(dim=-1)
        weights, chosen = probs.topk(self.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Route, sort the (token, slot) rows by expert, dispatch, unsort, weighted sum over the k slots.

        Only permutations, expand and sums over slots: no scatter-add, so results are bitwise
        reproducible on GPUs too (an index_add would accumulate with atomics there).
        """
        flat = x.reshape(-1, x.shape[-1])
        tokens, hidden = flat.shape
        weights, chosen = self.route(flat)
        expert_of = chosen.reshape(-1)  # row t * k + slot: (token t, slot)
        order = torch.argsort(expert_of, stable=True)
        counts = torch.bincount(expert_of, minlength=self.num_experts)
        self.tokens_per_expert = counts.detach()
        rows = flat.unsqueeze(1).expand(tokens, self.top_k, hidden).reshape(-1, hidden)
        out_rows = self.dispatch(self, rows.index_select(0, order), counts)
        per_slot = out_rows.index_select(0, torch.argsort(order)).view(tokens, self.top_k, hidden)
        return (per_slot * weights.unsqueeze(-1)).sum(1).view_as(x)


def moe_modules(module: nn.Module) -> list[tuple[str, MoE]]:
    """(qualified name, MoE) of every MoE in ``module``."""
    return [(name, m) for name, m in module.named_modules() if isinstance(m, MoE)]


def split_experts(
    module: nn.Module, ep_group: dist.ProcessGroup | None, ep_size: int | None = None, ep_rank: int | None = None
) -> nn.Module:
    """In place: every MoE keeps experts ``ep_rank*E/ep_size .. (ep_rank+1)*E/ep_size - 1`` (the very
    modules built from the seed, so their weights equal the full model's) and dispatches over ``ep_group``.

    ``ep_size``/``ep_rank`` default to the group's; when a process group exists they must match it.
    Returns ``module``.
    """
    if ep_size is None or ep_rank is None:
        ep_size, ep_rank = dist.get_world_size(ep_group), dist.get_rank(ep_group)
    if dist.is_initialized() and (ep_size, ep_rank) != (dist.get_world_size(ep_group), dist.get_rank(ep_group)):
        raise ValueError(f"ep_size={ep_size}, ep_rank={ep_rank} do not match ep_group")
    if not 0 <= ep_rank < ep_size:
        raise ValueError(f"ep_rank={ep_rank} not in 0..{ep_size - 1}")
    moes = moe_modules(module)
    if not moes:
        raise ValueError("split_experts: the module holds no MoE")
    for name, moe in moes:
        if moe.num_experts % ep_size or len(moe.experts) != moe.num_experts:
            raise ValueError(f"{name}: cannot split {len(moe.experts)}/{moe.num_experts} experts over {ep_size}")
        per_rank = moe.num_experts // ep_size
        keep = list(range(ep_rank * per_rank, (ep_rank + 1) * per_rank))
        moe.experts = nn.ModuleList(moe.experts[i] for i in keep)
        moe.expert_ids = keep
        moe.dispatch = ExpertParallelDispatch(ep_group, ep_size, ep_rank)
    return module


def expert_name_map(model: nn.Module) -> dict[str, str]:
    """Every param name of ``model`` -> the full (unsplit) model's name: local expert j -> expert_ids[j]."""
    names = {name: name for name, _ in model.named_parameters()}
    for prefix, moe in moe_modules(model):
        base = f"{prefix}.experts" if prefix else "experts"
        for j, global_id in enumerate(moe.expert_ids):
            for pname, _ in moe.experts[j].named_parameters():
                local = f"{base}.{j}.{pname}"
                if local in names:
                    names[local] = f"{base}.{global_id}.{pname}"
    return names


# --------------------------------------------------------------------------------------
# Losses


def expert_params(model: nn.Module, names: dict[str, str]) -> dict[str, dict[str, nn.Parameter]]:
    """The experts a (possibly expert-parallel) model holds, by global expert name
    (``layers.1.ffn.experts.<global id>``), each with its params keyed by the full model's names
    (``names``: ``expert_name_map(model)``)."""
    experts: dict[str, dict[str, nn.Parameter]] = {}
    for name, param in model.named_parameters():
        full_name = names.get(name, name)
        if ".experts." in full_name:
            expert = full_name.rsplit(".", 2)[0]  # drop "<projection>.weight"
            experts.setdefault(expert, {})[full_name] = param
    return experts


def summed_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The sum of the tokens' cross entropies (divide by a global token count for a global mean)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")


def cross_entropy_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross entropy over all tokens of [..., V] logits (the unchunked reference)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, total: int) -> torch.Tensor:
    """Summed CE of one chunk divided by the total token count (chunk losses add up to the mean)."""
    return F.cross_entropy(hidden @ weight.t(), targets, reduction="sum") / total


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int = CE_CHUNK
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Mean CE of ``hidden [N, H] @ weight[V, H].T`` against ``targets [N]``, ``chunk`` tokens at a time.

    Each chunk runs under non-reentrant checkpoint, so its [chunk, V] logits are recomputed in backward
    instead of kept. Returns (total, per-chunk losses); ``total`` is the per-chunk losses added in order
    (``sum(per_chunk)``), so that sum equals it bitwise.
    """
    n = hidden.shape[0]
    losses = [
        checkpoint(_chunk_loss, h, weight, t, n, use_reentrant=False)
        for h, t in zip(hidden.split(chunk), targets.split(chunk), strict=True)
    ]
    return sum(losses[1:], losses[0]), losses


# --------------------------------------------------------------------------------------
# Decoder LLM


class DecoderBlock(nn.Module):
    """Pre-norm block: ``x + attn(norm1(x))`` then ``x + ffn(norm2(x))``."""

    def __init__(self, hidden: int, heads: int, ffn: nn.Module) -> None:
        super().__init__()
        self.norm1 = RMSNorm(hidden)
        self.attn = CausalSelfAttention(hidden, heads)
        self.norm2 = RMSNorm(hidden)
        self.ffn = ffn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


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
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits [B, S, vocab] of tokens [B, S]; with ``targets`` instead the chunked CE (total, per-chunk).

        Everything runs inside forward (the loss too), because a ``fully_shard``-ed module's params are
        whole only there: call the other methods directly only on unsharded models. ``prefix``: embeddings
        [B, P, H] prepended to the token embeddings (visual tokens), not in the output. ``inject``: see
        ``forward_embeddings``.
        """
        hidden = self.hidden_states(tokens, prefix, inject)
        if targets is None:
            return self.head(hidden)
        return chunked_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]), self.head.weight, targets.reshape(-1), ce_chunk
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
# Vision transformer


class EncoderBlock(nn.Module):
    """Pre-norm ViT block: ``x + attn(norm1(x))`` then ``x + mlp(norm2(x))`` (LayerNorm, GELU MLP)."""

    def __init__(self, hidden: int, heads: int, mlp_inner: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden)
        self.attn = SelfAttention(hidden, heads)
        self.norm2 = nn.LayerNorm(hidden)
        self.mlp = GeluMLP(hidden, mlp_inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


@dataclass(frozen=True)
class ViTConfig:
    """Sizes of a ``ViT``."""

    image: int = 224
    patch: int = 16
    channels: int = 3
    hidden: int = 256
    layers: int = 6
    heads: int = 4
    mlp_inner: int = 1024
    classes: int = 10  # 0: no classifier head (a vision tower)
    seed: int = 0

    @property
    def patches(self) -> int:
        """Patch tokens per image."""
        return (self.image // self.patch) ** 2


class ViT(nn.Module):
    """Conv patch embedding + CLS token + learned positions -> encoder blocks -> LayerNorm -> CLS head."""

    def __init__(self, config: ViTConfig | None = None) -> None:
        super().__init__()
        self.config = c = config or ViTConfig()
        torch.manual_seed(c.seed)
        if c.image % c.patch:
            raise ValueError(f"patch={c.patch} does not divide image={c.image}")
        self.patch_embed = nn.Conv2d(c.channels, c.hidden, c.patch, stride=c.patch)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, c.hidden))
        self.pos_embed = nn.Parameter(0.02 * torch.randn(1, 1 + c.patches, c.hidden))
        self.blocks = nn.ModuleList(EncoderBlock(c.hidden, c.heads, c.mlp_inner) for _ in range(c.layers))
        self.norm = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.classes) if c.classes else None

    def block_outputs(self, images: torch.Tensor) -> list[torch.Tensor]:
        """Each block's output [B, 1 + P, H] (CLS first), before the final norm."""
        x = self.patch_embed(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        outputs = []
        for block in self.blocks:
            x = block(x)
            outputs.append(x)
        return outputs

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """All tokens after the final norm [B, 1 + P, H]."""
        return self.norm(self.block_outputs(images)[-1])

    def forward(
        self, images: torch.Tensor, taps: tuple[int, ...] = ()
    ) -> torch.Tensor | tuple[torch.Tensor, list[torch.Tensor]]:
        """Logits [B, classes] from the CLS token, or the normed tokens [B, 1 + P, H] when the ViT has no
        head (``classes=0``); with ``taps``, (that, [output of block i for i in taps]) (DeepStack).

        Under ``fully_shard`` only forward sees whole params: use it rather than ``features``.
        """
        outputs = self.block_outputs(images)
        tokens = self.norm(outputs[-1])
        result = tokens if self.head is None else self.head(tokens[:, 0])
        return (result, [outputs[i] for i in taps]) if taps else result


def vit(seed: int = 0) -> ViT:
    """L3-04: image 224, patch 16, hidden 256, 6 blocks, 10 classes."""
    return ViT(ViTConfig(seed=seed))


# --------------------------------------------------------------------------------------
# Multimodal (DeepStack)


class Multimodal(nn.Module):
    """L3-06: ViT (hidden 128, 4 blocks, no head) -> projector MLP -> 2-layer decoder (hidden 256), DeepStack.

    The projected patch tokens of the last ViT block (after the ViT's norm) are prepended to the text
    embeddings; the projection of the middle block's (index ``deep_block``, un-normed) patch tokens is
    added to the visual positions after decoder block ``deep_layer``. Logits cover the text positions.
    ``vision``, ``projector`` and ``language`` are separate attributes, each called once through its own
    forward, so each can be sharded on its own.
    """

    deep_block = 1  # ViT block whose output is stacked into the decoder
    deep_layer = 0  # decoder block after which it is added

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        self.vision = ViT(ViTConfig(hidden=128, layers=4, heads=4, mlp_inner=512, classes=0, seed=seed))
        self.language = Decoder(DecoderConfig(vocab=1024, hidden=256, layers=2, heads=4, ffn_inner=768, seed=seed + 1))
        torch.manual_seed(seed + 2)
        self.projector = GeluMLP(128, 256, 256)

    def forward(self, images: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """images [B, C, 224, 224], tokens [B, S] -> logits [B, S, vocab]."""
        features, (middle,) = self.vision(images, taps=(self.deep_block,))
        patches = features.shape[1] - 1
        projected = self.projector(torch.cat([features[:, 1:], middle[:, 1:]], dim=1))  # one call for both
        visual, deep = projected.split(patches, dim=1)
        return self.language(tokens, prefix=visual, inject={self.deep_layer: (slice(0, patches), deep)})


# --------------------------------------------------------------------------------------
# Seeded data


def _generator(seed: int, step: int, rank: int) -> torch.Generator:
    """A generator that differs per rank and per step and is reproducible anywhere."""
    return torch.Generator().manual_seed(seed + 7919 * step + rank)


def token_batch(
    step: int, rank: int, batch: int, seq: int, vocab: int, seed: int = 3000
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, S], targets [B, S]) where targets are the next tokens of one drawn sequence."""
    ids = torch.randint(0, vocab, (batch, seq + 1), generator=_generator(seed, step, rank))
    return ids[:, :-1].contiguous(), ids[:, 1:].contiguous()


def global_token_batch(
    step: int, rank: int, world: int, batch: int, seq: int, vocab: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's (tokens, targets) and every rank's concatenated, in rank order (the global batch a
    single-device baseline trains on)."""
    every = [token_batch(step, r, batch, seq, vocab) for r in range(world)]
    tokens, targets = every[rank]
    return tokens, targets, torch.cat([t for t, _ in every]), torch.cat([t for _, t in every])


def image_batch(
    step: int, rank: int, batch: int, image: int = 224, channels: int = 3, classes: int = 10, seed: int = 4000
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images [B, C, image, image] ~ N(0, 1), labels [B])."""
    generator = _generator(seed, step, rank)
    images = torch.randn(batch, channels, image, image, generator=generator)
    return images, torch.randint(0, classes, (batch,), generator=generator)


def param_count(module: nn.Module) -> int:
    """Number of distinct parameter elements (a tied weight counts once)."""
    return sum(p.numel() for p in module.parameters())
