"""Mixture of experts and its dispatch: every expert local, or expert parallel (each rank keeps its
slice of the experts and a differentiable all-to-all carries every token to its experts' owner and
back), with the name map and grouping the cases compare them by."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
from torch import nn

from tests.kit.workloads.blocks import SwiGLU


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
