"""Linear methods: how a linear layer stores and multiplies its weight after loading.

Models are written against plain (N, K) weights. Once the checkpoint is in, the runner hands
every linear layer's weight to the method that `--quantization` and the platform select: the
method returns a prepared state (a prepacked weight, int8/int4 codes and scales, ...) and the
layer multiplies through it from then on. Backends register methods in the op registry under
`linear.<name>` (`linear.none` for unquantized weights, `linear.wint8`, `linear.wint4`, ...);
`linear.none` defaults to torch's own `F.linear` on the unchanged weight. So a vendor adds a
packed or quantized GEMM without touching a model."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heterollm.model_executor import ops


class LinearMethod(ABC):
    """One way to run y = x W^T + b. Instances are stateless; each layer keeps its own state."""

    name: str = ""

    @abstractmethod
    def prepare(self, weight: torch.Tensor) -> Any:
        """Called once after loading with this rank's full weight (N, K) in the model dtype; returns
        what `apply` multiplies with. The layer drops its own copy of the weight afterwards unless
        another module shares it (a tied embedding)."""

    @abstractmethod
    def apply(self, state: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x (M, K) -> (M, N) in x's dtype."""

    def reload(self, state: Any, weight: torch.Tensor) -> Any:
        """New weights for a prepared layer (`--dynamic_load_weight`); returns the state `apply` uses
        from now on. The default prepares afresh; a method whose state a captured graph holds by
        reference refreshes that state in place and returns it."""
        return self.prepare(weight)


class LinearBase(nn.Module):
    """What the layer API's linear layers share: a weight (N, K) and, after `prepare_linears`,
    the method and state that replace it."""

    weight: nn.Parameter
    method: LinearMethod | None = None
    state: Any = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.method is None:
            return F.linear(x, self.weight, bias)
        return self.method.apply(self.state, x, bias)


# the torch default for unquantized weights: no method, plain F.linear
ops.register("linear.none")(None)


def select_linear_method(quantization: str | None) -> LinearMethod | None:
    """The active family's method for `quantization` (None: unquantized); None means plain
    F.linear. Raises ValueError naming what the platform offers when it has no such method."""
    key = f"linear.{quantization or 'none'}"
    if not ops.has(key):
        offered = sorted(n.removeprefix("linear.") for n in ops.names() if n.startswith("linear.") and n != "linear.none")
        raise ValueError(f"--quantization={quantization}: not supported by the selected backend "
                         f"(it offers: {', '.join(offered) or 'none'})")
    factory = ops.get(key)
    return factory() if factory is not None else None


def prepare_linears(model: nn.Module, method: LinearMethod | None) -> int:
    """Move every linear layer of `model` onto `method`; returns how many layers it prepared.
    A weight another module still uses (tied embeddings) is kept; the others are released. Layers of
    a quantized checkpoint (no float `weight`) are quant_linear's `prepare_quantized`'s."""
    if method is None:
        return 0
    layers = [m for m in model.modules() if isinstance(m, LinearBase) and m.weight is not None
              and not getattr(m, "dp_sharded", False)]  # gathered by rows at each use (weight_sharding.py)
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    for layer in layers:
        layer.state = method.prepare(layer.weight.data)
        layer.method = method
        if users.get(id(layer.weight), 0) <= 1:
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)
    return len(layers)


def unpack_for_reload(model: nn.Module, dry: nn.Module, touched: set[str], complete: set[str]) -> list[LinearBase]:
    """Before new weights are loaded (`--dynamic_load_weight`): each prepared linear layer they write
    gets a full-size weight again to receive them (`dry`: the same model on the meta device gives the
    shapes). A prepared weight is packed, so the new weights must give all of it (every part of a
    merged q/k/v or gate/up); else WeightUpdateError, before anything changed."""
    from heterollm.model_executor.weight_update import WeightUpdateError

    shapes = {name: p.shape for name, p in dry.named_parameters(remove_duplicate=False)}
    layers = [(f"{name}.weight", m) for name, m in model.named_modules()
              if isinstance(m, LinearBase) and m.method is not None and f"{name}.weight" in touched]
    partial = [name for name, _ in layers if name not in complete]
    if partial:
        raise WeightUpdateError("path", f"the new weights give only part of {partial[0]} (e.g. q_proj without "
                                        f"k_proj and v_proj); its layer is prepacked, so send every part of it")
    for name, layer in layers:
        if layer.weight.numel() == 0:
            layer.weight.data = torch.empty(shapes[name], dtype=layer.weight.dtype, device=layer.weight.device)
    return [layer for _, layer in layers]


def repack_after_reload(model: nn.Module, layers: list[LinearBase]) -> None:
    """After new weights are loaded: each layer's method takes its new weight (`LinearMethod.reload`),
    and the layer's copy is released again unless another module shares it."""
    users: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            users[id(p)] = users.get(id(p), 0) + 1
    for layer in layers:
        layer.state = layer.method.reload(layer.state, layer.weight.data)
        if users.get(id(layer.weight), 0) <= 1:
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype, device=layer.weight.device)


def state_bytes(state: Any) -> int:
    """Bytes held by a prepared state: a tensor, a tuple of tensors (and plain numbers), or an object
    with an `nbytes` attribute."""
    if isinstance(state, torch.Tensor):
        if state.is_mkldnn:  # opaque prepacked layout: its logical size is the best estimate
            return state.numel() * state.element_size()
        return state.untyped_storage().nbytes()
    if isinstance(state, (tuple, list)):
        return sum(state_bytes(s) for s in state)
    return int(getattr(state, "nbytes", 0))  # a method's own holder object may say its size


def model_bytes(model: nn.Module) -> int:
    """Weight memory of a loaded model: its parameters (each counted once) plus prepared states (of the
    linear layers, and of modules that set `prepared_experts`: MoE experts under --quantization)."""
    params = {id(p): p for p in model.parameters()}.values()
    total = sum(p.numel() * p.element_size() for p in params)
    return total + sum(state_bytes(m.state) for m in model.modules()
                       if isinstance(m, LinearBase) or getattr(m, "prepared_experts", False))
