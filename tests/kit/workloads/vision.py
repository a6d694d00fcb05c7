"""The plan's vision networks (L3-04, L3-06), written once: the ViT and the multimodal DeepStack
stack (ViT -> projector -> decoder), and seeded image data."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tests.kit.workloads.blocks import EncoderBlock, GeluMLP
from tests.kit.workloads.networks import Decoder, DecoderConfig, seeded_generator


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


def image_batch(
    step: int, rank: int, batch: int, image: int = 224, channels: int = 3, classes: int = 10, seed: int = 4000
) -> tuple[torch.Tensor, torch.Tensor]:
    """(images [B, C, image, image] ~ N(0, 1), labels [B])."""
    generator = seeded_generator(seed, step, rank)
    images = torch.randn(batch, channels, image, image, generator=generator)
    return images, torch.randint(0, classes, (batch,), generator=generator)
