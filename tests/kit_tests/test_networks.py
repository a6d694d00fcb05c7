"""Tests of the plan's real networks (tests/kit/workloads/networks.py): sizes, determinism, MoE routing and
dispatch (local and expert parallel), chunked cross entropy, ViT, multimodal DeepStack, seeded data."""

from __future__ import annotations

import copy
import time

import pytest
import torch
import torch.nn.functional as F

from tests.kit.judging.tolerances import specific, tolerance
from tests.kit.workloads.blocks import SwiGLU
from tests.kit.workloads.moe import ExpertParallelDispatch, MoE, expert_name_map, run_experts, split_experts
from tests.kit.workloads.networks import (
    MOE_SEQ,
    Decoder,
    DecoderConfig,
    chunked_ce_decoder,
    chunked_cross_entropy,
    cross_entropy_loss,
    llm_decoder,
    moe_decoder,
    param_count,
    token_batch,
)
from tests.kit.workloads.vision import Multimodal, ViTConfig, image_batch, vit
from tests.kit_tests import _ranks_networks as ranks

EXACT = specific("reordered fp32")  # same math in another order (chunking, dispatch) on one process
EP_TOL = tolerance("FSDP 1D fp32").grad  # expert-parallel vs the full model: other batch sizes in the matmuls


def _decoder_params(c: DecoderConfig) -> int:
    """Expected parameter count of a Decoder (tied head counted once)."""
    h = c.hidden
    dense = 3 * h * c.ffn_inner
    moe = h * c.experts + c.experts * 3 * h * c.expert_inner
    layers = sum(2 * h + 4 * h * h + (moe if i in c.moe_layers else dense) for i in range(c.layers))
    return c.vocab * h + layers + h


def _vit_params(c: ViTConfig) -> int:
    """Expected parameter count of a ViT."""
    h, i = c.hidden, c.mlp_inner
    block = 4 * h + (3 * h * h + 3 * h) + (h * h + h) + (h * i + i) + (i * h + h)
    patch = c.channels * h * c.patch**2 + h
    return patch + h + (1 + c.patches) * h + c.layers * block + 2 * h + h * c.classes + c.classes


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape
    return (a.detach().double() - b.detach().double()).abs().max().item()


def _tiny_decoder(**kwargs) -> Decoder:
    """A decoder small enough for exact single-process checks."""
    return Decoder(DecoderConfig(**{"vocab": 97, "hidden": 32, "layers": 2, "heads": 2, "ffn_inner": 48, **kwargs}))


# --------------------------------------------------------------------------------------
# Presets


@pytest.mark.parametrize("factory", [llm_decoder, moe_decoder, chunked_ce_decoder])
def test_decoder_presets(factory):
    model = factory()
    c = model.config
    assert model.head.weight is model.embed.weight
    assert param_count(model) == _decoder_params(c)
    assert len(model.layers) == c.layers
    moe_layers = [i for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoE)]
    dense_layers = [i for i, layer in enumerate(model.layers) if isinstance(layer.ffn, SwiGLU)]
    assert moe_layers == list(c.moe_layers)
    assert sorted(moe_layers + dense_layers) == list(range(c.layers))
    tokens, _ = token_batch(0, 0, 2, 8, c.vocab)
    assert model(tokens).shape == (2, 8, c.vocab)
    assert model.hidden_states(tokens).shape == (2, 8, c.hidden)


def test_preset_sizes_are_the_plans():
    assert llm_decoder().config == DecoderConfig(vocab=1024, hidden=256, layers=4, heads=4)
    moe = moe_decoder().config
    assert (moe.layers, moe.moe_layers, moe.experts, moe.top_k) == (4, (1, 3), 4, 2)
    assert moe.expert_inner == 2 * moe.hidden == 512
    assert moe_decoder().layers[1].ffn.expert_ids == [0, 1, 2, 3]
    ce = chunked_ce_decoder().config
    assert (ce.layers, ce.vocab, ce.hidden) == (2, 32768, 256)
    v = vit().config
    assert (v.image, v.patch, v.hidden, v.layers) == (224, 16, 256, 6)


def test_vit_shapes_and_params():
    model = vit()
    c = model.config
    assert param_count(model) == _vit_params(c)
    images, labels = image_batch(0, 0, 2)
    assert model(images).shape == (2, c.classes)
    assert model.features(images).shape == (2, 1 + 196, c.hidden)
    outputs = model.block_outputs(images)
    assert len(outputs) == 6 and all(o.shape == (2, 197, 256) for o in outputs)
    logits, (middle,) = model(images, taps=(1,))
    assert torch.equal(middle, outputs[1]) and torch.equal(logits, model(images))
    assert labels.shape == (2,) and 0 <= labels.min() and labels.max() < c.classes


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("factory", [llm_decoder, moe_decoder, chunked_ce_decoder, vit, Multimodal])
def test_construction_is_deterministic(factory):
    a, b, other = _state(factory(0)), _state(factory(0)), _state(factory(1))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], other[k]) for k in a if a[k].is_floating_point() and a[k].numel() > 1)


# --------------------------------------------------------------------------------------
# MoE


def _naive_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """Token by token: softmax router, top-k, renormalised weights, weighted sum of expert outputs."""
    flat = x.reshape(-1, x.shape[-1])
    rows = []
    for token in flat:
        probs = torch.softmax(moe.router(token), dim=-1)
        weights, chosen = probs.topk(moe.top_k)
        weights = weights / weights.sum()
        rows.append(sum(w * moe.experts[int(e)](token) for w, e in zip(weights, chosen, strict=True)))
    return torch.stack(rows).view_as(x)


def test_moe_matches_naive_per_token_loop():
    torch.manual_seed(0)
    moe = MoE(hidden=16, experts=4, top_k=2, inner=8)
    ref = copy.deepcopy(moe)
    x = torch.randn(3, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, out_ref = moe(x), _naive_moe(ref, x_ref)
    assert _max_diff(out, out_ref) <= EXACT
    assert moe.tokens_per_expert.sum().item() == 15 * 2
    probe = torch.randn_like(out)
    (out * probe).sum().backward()
    (out_ref * probe).sum().backward()
    assert _max_diff(x.grad, x_ref.grad) <= EXACT
    params = dict(ref.named_parameters())
    for name, param in moe.named_parameters():
        ref_grad = params[name].grad
        assert ref_grad is not None or not param.grad.any(), name  # an unused expert: zero grad here, None there
        if ref_grad is not None:
            assert _max_diff(param.grad, ref_grad) <= EXACT, name
    assert moe.router.weight.grad.abs().sum() > 0


def test_run_experts_gives_unused_experts_zero_grads():
    torch.manual_seed(0)
    moe = MoE(hidden=8, experts=4, top_k=1, inner=4)
    rows = torch.randn(5, 8, requires_grad=True)
    run_experts(moe.experts, rows, [3, 0, 2, 0]).sum().backward()
    assert moe.experts[0].w_up.weight.grad.abs().sum() > 0
    assert moe.experts[1].w_up.weight.grad is not None and not moe.experts[1].w_up.weight.grad.any()


def test_split_experts_and_name_map():
    full, split = moe_decoder(), split_experts(moe_decoder(), None, 2, 1)
    names = expert_name_map(split)
    assert names["layers.1.ffn.experts.0.w_up.weight"] == "layers.1.ffn.experts.2.w_up.weight"
    assert names["layers.3.ffn.experts.1.w_down.weight"] == "layers.3.ffn.experts.3.w_down.weight"
    assert names["layers.1.ffn.router.weight"] == "layers.1.ffn.router.weight"
    assert names["embed.weight"] == "embed.weight"
    reference = dict(full.named_parameters())
    assert set(names) == {n for n, _ in split.named_parameters()}
    for local, param in split.named_parameters():
        assert torch.equal(param, reference[names[local]]), local
    assert sum(".experts." in n for n in names) == 2 * 2 * 3
    moe = split.layers[1].ffn
    assert moe.expert_ids == [2, 3] and len(moe.experts) == 2
    assert isinstance(moe.dispatch, ExpertParallelDispatch)
    assert copy.deepcopy(split).layers[3].ffn.dispatch is split.layers[3].ffn.dispatch  # the group is shared


@pytest.mark.parametrize(
    "build, size, rank",
    [
        (moe_decoder, 3, 0),
        (moe_decoder, 2, 2),
        (llm_decoder, 2, 0),
        (lambda: split_experts(moe_decoder(), None, 2, 0), 2, 0),
    ],
)
def test_split_experts_refuses(build, size, rank):
    with pytest.raises(ValueError):
        split_experts(build(), None, size, rank)


def test_expert_parallel_matches_full_model(cluster):
    out = cluster.run(ranks.expert_parallel_vs_full, 2)
    print({k: v for o in out for k, v in o.items() if k.endswith("err")})
    assert [o["expert_ids"] for o in out] == [[[0, 1], [0, 1]], [[2, 3], [2, 3]]]
    # preconditions: the ranks' data differ, and each rank routes rows to the other rank's experts
    assert out[0]["loss"] != out[1]["loss"]
    for rank, o in enumerate(out):
        for counts in o["tokens_per_expert"]:
            remote = counts[2:] if rank == 0 else counts[:2]
            assert sum(remote) > 0 and len(set(counts)) > 1, counts
    for o in out:
        assert o["expert_params"] == 2 * 2 * 3
        assert o["expert_grad_norm_min"] > EP_TOL  # above the tolerance: a missing grad cannot pass
        for key in ("logits_err", "loss_err", "expert_grad_err", "dense_grad_err"):
            assert o[key] <= EP_TOL, (key, o[key])


def test_moe_decoder_step_is_cheap_on_cpu():
    model = moe_decoder()
    tokens, targets = token_batch(0, 0, 2, MOE_SEQ, model.config.vocab)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        cross_entropy_loss(model(tokens), targets).backward()
        times.append(time.perf_counter() - t0)
    print(f"MoE decoder forward+backward at 2 x {MOE_SEQ}: {min(times) * 1e3:.0f} ms (first {times[0] * 1e3:.0f} ms)")
    assert min(times) < 1.0


# --------------------------------------------------------------------------------------
# Chunked cross entropy


def test_chunked_cross_entropy_matches_full():
    gen = torch.Generator().manual_seed(0)
    n, h, v, chunk = 1200, 32, 300, 512
    hidden = torch.randn(n, h, generator=gen, requires_grad=True)
    weight = (0.1 * torch.randn(v, h, generator=gen)).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=gen)
    saved: list[torch.Size] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(t.shape)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        total, parts, whole = chunked_cross_entropy(hidden, weight, targets, chunk, whole=True)
    assert [p.numel() for p in parts] == [1, 1, 1]
    assert all(s.numel() < chunk * v for s in saved), saved  # no chunk's logits kept for backward
    grads = torch.autograd.grad(total, (hidden, weight))

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        reference = F.cross_entropy(hidden @ weight.t(), targets)
    assert any(s.numel() >= n * v for s in saved)  # the unchunked path does keep them: the probe sees it
    ref_grads = torch.autograd.grad(reference, (hidden, weight))
    assert abs(total.item() - reference.item()) <= EXACT
    assert abs(sum(parts).item() - whole.item()) <= specific("chunk sum")
    assert abs(whole.item() - reference.item()) <= EXACT and not whole.requires_grad
    for ours, theirs in zip(grads, ref_grads, strict=True):
        assert _max_diff(ours, theirs) <= EXACT


def test_decoder_chunked_loss_equals_unchunked():
    model, ref = _tiny_decoder(), _tiny_decoder()
    tokens, targets = token_batch(0, 0, 2, 300, model.config.vocab)
    total, parts, _ = model(tokens, targets, ce_chunk=256)
    assert len(parts) == 3
    reference = cross_entropy_loss(ref(tokens), targets)
    assert abs(total.item() - reference.item()) <= EXACT
    total.backward()
    reference.backward()
    assert _max_diff(model.embed.weight.grad, ref.embed.weight.grad) <= EXACT
    assert _max_diff(model.layers[0].attn.q.weight.grad, ref.layers[0].attn.q.weight.grad) <= EXACT


# --------------------------------------------------------------------------------------
# Multimodal


def test_forward_embeddings_injects_after_the_named_layer():
    model = _tiny_decoder()
    x = torch.randn(2, 6, 32)
    extra = torch.randn(2, 2, 32)
    manual = model.layers[0](x)
    manual = torch.cat([manual[:, :2] + extra, manual[:, 2:]], dim=1)
    manual = model.norm(model.layers[1](manual))
    assert _max_diff(model.forward_embeddings(x, {0: (slice(0, 2), extra)}), manual) <= EXACT
    assert _max_diff(model.forward_embeddings(x), manual) > EXACT  # the injection changes the output
    tokens, _ = token_batch(0, 0, 2, 4, model.config.vocab)
    prefix = torch.randn(2, 3, 32)
    whole = model.forward_embeddings(torch.cat([prefix, model.embed(tokens)], dim=1), {0: (slice(0, 2), extra)})
    logits = model(tokens, prefix=prefix, inject={0: (slice(0, 2), extra)})
    assert torch.equal(logits, model.head(whole[:, 3:]))


def test_multimodal_forward_and_grads_cross_the_projector():
    model = Multimodal(0)
    assert model.vision.config == ViTConfig(hidden=128, layers=4, heads=4, mlp_inner=512, classes=0, seed=0)
    assert model.vision.head is None  # a vision tower: no classifier param left without a grad
    lang = model.language.config
    assert (lang.hidden, lang.layers, lang.vocab) == (256, 2, 1024)
    images, _ = image_batch(0, 0, 1)
    tokens, targets = token_batch(0, 0, 1, 8, 1024)
    logits = model(images, tokens)
    assert logits.shape == (1, 8, 1024)
    cross_entropy_loss(logits, targets).backward()
    assert model.projector.fc1.weight.grad.abs().sum() > 0
    assert model.vision.patch_embed.weight.grad.abs().sum() > 0
    assert all(p.grad is not None for p in model.parameters())  # every param is on the path
    with torch.no_grad():
        model.deep_layer = len(model.language.layers)  # no layer with that index: DeepStack off
        assert _max_diff(model(images, tokens), logits) > EXACT  # DeepStack changes the output


# --------------------------------------------------------------------------------------
# Seeded data


def test_token_and_image_batches_are_seeded_per_rank_and_step():
    tokens, targets = token_batch(3, 1, 2, 16, 50)
    assert tokens.shape == targets.shape == (2, 16)
    assert torch.equal(tokens[:, 1:], targets[:, :-1])
    assert torch.equal(token_batch(3, 1, 2, 16, 50)[0], tokens)
    assert not torch.equal(token_batch(3, 0, 2, 16, 50)[0], tokens)
    assert not torch.equal(token_batch(4, 1, 2, 16, 50)[0], tokens)
    images, labels = image_batch(2, 1, 2, image=32)
    assert images.shape == (2, 3, 32, 32) and labels.shape == (2,)
    assert torch.equal(image_batch(2, 1, 2, image=32)[0], images)
    assert not torch.equal(image_batch(2, 0, 2, image=32)[0], images)
    assert not torch.equal(image_batch(3, 1, 2, image=32)[0], images)
