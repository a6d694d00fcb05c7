"""The model grammar of L4: the ``nn.Module`` a configuration describes, built from its seed.

``Net`` takes the configuration's input (a tensor, integer tokens, a dict, or keywords), runs its
body (nested ``Sequential`` / ``ModuleList`` blocks / residual and tied blocks of ``Linear``,
``LayerNorm``, RMSNorm and ``Conv1d`` leaves, some frozen, some with buffers, some under activation
checkpointing) and returns the configuration's output (a tensor, a tuple, a dict or a dataclass).
Every leaf computes in its own weight's dtype (casting what it is given), so a mixed-precision
policy, an ignored fp32 param inside a bf16 group and ``cast_forward_inputs=False`` all run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.kit.explore.space import Config, Layer, Node

AGAIN = ("mtp", "head")  # ``list_module_called_again``'s modules: the block, then the head it calls
INIT = 0.5  # weights ~ U(-INIT / sqrt(fan_in), ...): small grads, so low-precision rounding stays small


@dataclass
class Out:
    """The dataclass output kind."""

    y: torch.Tensor
    aux: torch.Tensor


class Leaf(nn.Module):
    """One leaf of the grammar, computing in its weight's dtype; where a pattern says
    (``tests.kit.explore.patterns``), returning a view of its output (``view_out``), or storing an
    intermediate, computed from its input and weight after its output, for the loss (``stores``)."""

    view_out = False
    stores = False
    stored: torch.Tensor | None = None

    def __init__(self, layer: Layer, width: int) -> None:
        super().__init__()
        # a LayerNorm over one feature outputs its bias whatever comes in: every grad before it is
        # rounding noise amplified by 1/sqrt(eps), which no two reduction orders agree on
        self.kind = "rmsnorm" if layer.kind == "layernorm" and width == 1 else layer.kind
        scale = INIT / width**0.5
        if layer.kind == "linear":
            self.weight = nn.Parameter(torch.empty(layer.out, width).uniform_(-scale, scale))
        elif layer.kind == "conv1d":
            self.weight = nn.Parameter(torch.empty(layer.channels, 1, layer.kernel).uniform_(-INIT, INIT))
        else:  # the norms: a scale per feature
            self.weight = nn.Parameter(1 + torch.empty(width).uniform_(-0.1, 0.1))
        biased = layer.bias and self.kind != "rmsnorm"  # RMSNorm has none (a param unused is no param here)
        self.bias = nn.Parameter(torch.empty(self.weight.shape[0]).uniform_(-0.1, 0.1)) if biased else None
        if layer.buffer:
            self.register_buffer("scale", torch.tensor(0.9))
        else:
            self.scale = None
        if layer.frozen:
            self.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        x = x.to(w.dtype)
        b = self.bias.to(w.dtype) if self.bias is not None else None
        if self.kind == "linear":
            out = F.linear(x, w, b)
        elif self.kind == "layernorm":  # the statistics in fp32 (half precision overflows them), as usual
            out = F.layer_norm(x.float(), (x.shape[-1],), w.float(), None if b is None else b.float()).to(w.dtype)
        elif self.kind == "rmsnorm":
            # over one feature x / sqrt(x^2 + eps) has the slope eps^-1/2 at 0 (316 for 1e-5): grads that
            # large differ in the fp32 rounding of two reduction orders by more than any absolute tolerance,
            # so there the eps is 1 (a smooth squashing, slope at most 1)
            eps = 1.0 if x.shape[-1] == 1 else 1e-5
            xf = x.float()
            out = (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)).to(w.dtype) * w
        else:  # conv1d over the feature axis, one input channel, averaged back over its channels
            out = F.conv1d(x.unsqueeze(1), w, b, padding=w.shape[-1] // 2).mean(1)
        out = out * self.scale.to(out.dtype) if self.scale is not None else out
        if self.stores and self.kind == "linear":
            self.stored = F.linear(x, w).float().mean()
        return out.view(out.shape) if self.view_out else out


class CallsHead(Leaf):
    """A multi-token block (``list_module_called_again``): a Linear leaf that calls the model's head
    (held, not registered: the head is the model's child) on its own output and stores the mean of
    what the head returned for the loss, as a multi-token-prediction block keeps its logits."""

    def __init__(self, width: int, head: Leaf) -> None:
        super().__init__(Layer("linear", width), width)
        object.__setattr__(self, "shared_head", head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.stored = None  # a forward stores afresh (the leaf's own term too, where it stores one)
        out = super().forward(x)
        logits = self.shared_head(out).float().mean()
        self.stored = logits if self.stored is None else self.stored + logits
        return out


class ListBlock(nn.Module):
    """Children in an ``nn.ModuleList``, looped over with a tanh between them."""

    def __init__(self, items: list[nn.Module]) -> None:
        super().__init__()
        self.items = nn.ModuleList(items)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, item in enumerate(self.items):
            x = item(x) if i == 0 else item(torch.tanh(x))
        return x


class Residual(nn.Module):
    """``x + inner(x)``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        return x.to(out.dtype) + out


class Tied(nn.Module):
    """Two square Linears sharing one weight (their biases their own)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = Leaf(Layer("linear", width), width)
        self.b = Leaf(Layer("linear", width), width)
        self.tie()

    def tie(self) -> None:
        """Share ``a``'s weight with ``b`` (again after ``to_empty``, which replaces a meta param
        with one new param per module holding it, as users of deferred init re-tie theirs)."""
        self.b.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class Checkpointed(nn.Module):
    """A block whose forward runs under torch's activation checkpoint."""

    def __init__(self, inner: nn.Module, how: str) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = how == "reentrant"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # re-entry needs an input that requires grad (else torch drops the block's grads): a block
        # fed the data itself is checkpointed without it
        reentrant = self.reentrant and x.requires_grad
        out = checkpoint(self.inner, x, use_reentrant=reentrant)
        # a view that a custom Function (the re-entrant checkpoint) returns may not be modified in place
        # (torch refuses it, with or without sharding): its user clones it (``inplace_on_output_view``)
        return out.clone() if reentrant and out._base is not None else out


def _build(node: Node, width: int) -> tuple[nn.Module, int]:
    """The module of ``node`` taking ``width`` features, and the width it returns."""
    if node.kind == "leaf":
        layer = node.layer
        return Leaf(layer, width), layer.out if layer.kind == "linear" else width
    if node.kind == "tied":
        module, out = Tied(width), width
    elif node.kind == "res":
        inner, out = _build(node.children[0], width)
        if out != width:  # the residual needs its width back
            inner = nn.Sequential(inner, Leaf(Layer("linear", width), out))
        module, out = Residual(inner), width
    else:
        built = []
        for child in node.children:
            module, width = _build(child, width)
            built.append(module)
        module, out = (nn.Sequential(*built) if node.kind == "seq" else ListBlock(built)), width
    return (Checkpointed(module, node.checkpoint) if node.checkpoint else module), out


class Net(nn.Module):
    """The configuration's model: input adapter, body, output adapter."""

    late_on = True  # whether the ``late`` head runs in this forward (False on a step's held micro-batches)

    def __init__(self, config: Config) -> None:
        super().__init__()
        torch.manual_seed(config.seed)
        self.input_kind, self.output_kind = config.input, config.output
        width = config.dim
        if config.input == "tokens":
            width = -(-8 // config.world) * config.world if config.even else 8  # even: rows of a multiple
            self.embed = nn.Embedding(config.dim, width)
            nn.init.uniform_(self.embed.weight, -INIT, INIT)  # as small as the leaves' inputs
        self.body, self.width = _build(config.body, width)
        # a head run only on each step's last micro-batch, or on some ranks (``late_on``, set by the driver)
        self.late = Leaf(Layer("linear", self.width), self.width) if config.has_late else None
        # a block that calls the head inside its forward, the head called again after it: L4's patterns
        head = Leaf(Layer("linear", self.width), self.width) if config.calls_again else None
        self.mtp = CallsHead(self.width, head) if head is not None else None
        self.head = head
        self.inplace_view = config.inplace_view
        for module in self.modules():
            if isinstance(module, Leaf):
                module.view_out, module.stores = config.inplace_view, config.stored_loss
        # the root's own param: a grad path whatever is frozen (one per feature where shards are even)
        self.gain = nn.Parameter(torch.ones(self.width if config.even else 1))

    def forward(self, x: Any, *, scale: torch.Tensor | None = None) -> Any:
        self.received = str((x["x"] if isinstance(x, dict) else x).dtype)  # after any cast of the inputs
        if self.input_kind == "tokens":
            x = self.embed(x)
        elif self.input_kind == "dict":
            x = x["x"]
        elif self.input_kind == "keyword":
            x = x * scale.to(x.dtype)
        y = self.body(x)
        if self.inplace_view:
            y.mul_(1.0)  # in place, on the view the body's last leaf returned
        if self.late is not None and self.late_on:
            z = self.late(y)
            y = y.to(z.dtype) + z
        if self.mtp is not None:
            m = self.mtp(y)
            z = self.head(y)
            y = y.to(z.dtype) + z + m.to(z.dtype)
        y = y * self.gain.to(y.dtype)
        aux = y.float().mean()
        if self.output_kind == "tuple":
            return y, aux
        if self.output_kind == "dict":
            return {"y": y, "aux": aux}
        if self.output_kind == "dataclass":
            return Out(y, aux)
        return y

    def generate(self, x: Any, *, scale: torch.Tensor | None = None) -> Any:
        """Another entry point, as a user's ``generate``: runs ``forward`` without ``__call__``, so
        only ``register_fsdp_forward_method`` gathers the root's params for it."""
        return self.forward(x, scale=scale)


def build(config: Config) -> Net:
    """The model of ``config`` (the same weights on every rank and every call)."""
    return Net(config)


def first_tensor(output: Any) -> torch.Tensor:
    """The model's main output, whatever structure carries it."""
    if isinstance(output, tuple):
        return output[0]
    if isinstance(output, dict):
        return output["y"]
    if isinstance(output, Out):
        return output.y
    return output


# Under half precision the loss is scaled by a power of two (exactly) so that every grad stays
# small: the precision matrix's half-precision rows are absolute (1e-3), and one bf16 ulp of a grad
# of 0.5 is already 2e-3, so at full scale the row could not tell a wrong reduction from rounding
# (seen with torch FSDP2 summing bf16 grads over 3 ranks in another order than the reference).
# At 1/128 even a sum over 8 ranks stays under 0.1, where an ulp of bf16 is 4.9e-4.
HALF_PRECISION_LOSS_SCALE = 1 / 128


def loss_of(output: Any, scale: float = 1.0, model: nn.Module | None = None) -> torch.Tensor:
    """The loss every configuration trains: the mean square of the main output, in fp32, plus the
    intermediates ``model``'s leaves stored in this forward, times ``scale``."""
    loss = first_tensor(output).float().square().mean()
    for module in model.modules() if model is not None else ():
        if isinstance(module, Leaf) and module.stored is not None:
            loss = loss + module.stored
    return loss * scale


def clear_stored(model: nn.Module) -> None:
    """Drop what ``model``'s leaves stored in an earlier forward (a forward stores afresh)."""
    for module in model.modules():
        if isinstance(module, Leaf):
            module.stored = None


def batch(config: Config, step: int, micro: int, rank: int) -> tuple[tuple, dict]:
    """The (args, kwargs) of one micro-batch of one rank: reproducible anywhere, different per rank."""
    generator = torch.Generator().manual_seed(config.seed * 7919 + 101 * step + 13 * micro + rank)
    if config.input == "tokens":
        return (torch.randint(0, config.dim, (4,), generator=generator),), {}
    x = torch.randn(4, config.dim, generator=generator)
    if config.input == "dict":
        return ({"x": x},), {}
    if config.input == "keyword":
        return (x,), {"scale": torch.tensor(1.5)}
    return (x,), {}


def tied_halves(model: nn.Module) -> list[str]:
    """The first half of each tied pair: a module a call may take only with the shared weight in its
    ignored_params (the other half, under the calls above, still holds that weight)."""
    return [f"{path}.a" if path else "a" for path, module in model.named_modules() if isinstance(module, Tied)]


def names(model: nn.Module) -> tuple[dict[str, int], dict[str, tuple[int, ...]]]:
    """The modules ``fully_shard`` may take (path -> depth; modules with params whose forward runs,
    so not a bare ModuleList, and not the halves of a tied pair: their weight must stay in one
    group) and the params (path -> shape; a tied weight under its first name)."""
    modules = {}
    for path, module in model.named_modules():
        parent = model.get_submodule(path.rpartition(".")[0]) if "." in path else model
        called = not isinstance(module, (nn.ModuleList, nn.ModuleDict))  # a container without a forward
        if path and called and not isinstance(parent, Tied) and any(True for _ in module.parameters()):
            modules[path] = path.count(".") + 1
    params = {path: tuple(p.shape) for path, p in model.named_parameters()}
    return modules, params
