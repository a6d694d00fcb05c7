"""Building blocks of the plan's networks: RMSNorm, attention (causal and not), SwiGLU and GELU
feed-forwards, and the pre-norm decoder and encoder blocks built from them."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
