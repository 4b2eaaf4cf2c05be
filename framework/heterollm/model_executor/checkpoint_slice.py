"""`--load_choices default_v1`: checkpoint tensors handed to the weight loaders before they are read.

A `CheckpointSlice` stands for a window of one checkpoint tensor (a safetensors slice, or a tensor
that `torch.load(mmap=True)` left on disk). `narrow`, basic slicing, `split` / `chunk` and `to(dtype)`
only move the window, so a tensor-parallel weight loader that narrows to its rank's rows or columns
reads just those bytes. Anything else (a reshape, an index tensor, a torch function such as
`Tensor.copy_`) reads the window there and then and carries on with a real tensor: loaders and model
transforms need no changes, and the ones that reorder whole tensors (GLM's rotary de-interleave,
quantized unpacking) simply read whole tensors, as the `default` loader always does.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}


@dataclass
class ReadStats:
    """Bytes of checkpoint tensors handed to the weight loaders (whole tensors, or the windows read),
    against the bytes the checkpoint holds."""

    read: int = 0
    stored: int = 0

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """Count `tensor`, read whole from the checkpoint."""
        self.read += _nbytes(tensor)
        self.stored += _nbytes(tensor)
        return tensor


class CheckpointSlice:
    """A not-yet-read window [start, stop) per dimension of a checkpoint tensor."""

    def __init__(self, read: Callable[[tuple[slice, ...]], torch.Tensor], shape: tuple[int, ...],
                 dtype: torch.dtype, window: tuple[tuple[int, int], ...] | None = None,
                 cast: torch.dtype | None = None) -> None:
        """`read(index)`: the stored tensor's values at `index` (one slice per dimension)."""
        self._read, self._stored_dtype = read, dtype
        self._window = window if window is not None else tuple((0, n) for n in shape)
        self._cast = cast

    # -- what a loader may ask without reading --------------------------------------------------
    @property
    def shape(self) -> torch.Size:
        return torch.Size(b - a for a, b in self._window)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    @property
    def dtype(self) -> torch.dtype:
        return self._cast or self._stored_dtype

    @property
    def ndim(self) -> int:
        return len(self._window)

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return self.shape.numel()

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"CheckpointSlice(window={self._window}, dtype={self.dtype})"

    # -- moving the window ----------------------------------------------------------------------
    def _with(self, window: tuple[tuple[int, int], ...] | None = None, cast: torch.dtype | None = None) -> CheckpointSlice:
        return CheckpointSlice(self._read, (), self._stored_dtype, self._window if window is None else window,
                               cast or self._cast)

    def narrow(self, dim: int, start: int, length: int) -> CheckpointSlice:
        dim = dim % self.ndim
        a, b = self._window[dim]
        if start < 0 or length < 0 or a + start + length > b:
            raise IndexError(f"narrow({dim}, {start}, {length}) is outside a dimension of size {b - a}")
        window = list(self._window)
        window[dim] = (a + start, a + start + length)
        return self._with(tuple(window))

    def __getitem__(self, index: Any) -> Any:
        index = index if isinstance(index, tuple) else (index,)
        if len(index) <= self.ndim and all(isinstance(i, slice) and i.step in (None, 1) for i in index):
            out = self
            for dim, i in enumerate(index):
                start, stop, _ = i.indices(out.shape[dim])
                out = out.narrow(dim, start, max(stop - start, 0))
            return out
        return self.materialize()[index]

    def split(self, sizes: int | list[int], dim: int = 0) -> tuple[CheckpointSlice, ...]:
        total = self.shape[dim]
        if isinstance(sizes, int):
            sizes = [min(sizes, total - s) for s in range(0, total, sizes)]
        if sum(sizes) != total:
            raise RuntimeError(f"split sizes {sizes} do not add up to {total}")
        starts = [sum(sizes[:i]) for i in range(len(sizes))]
        return tuple(self.narrow(dim, s, n) for s, n in zip(starts, sizes))

    def chunk(self, chunks: int, dim: int = 0) -> tuple[CheckpointSlice, ...]:
        return self.split(-(-self.shape[dim] // chunks), dim)

    def to(self, *args: Any, **kwargs: Any) -> Any:
        dtype = kwargs.get("dtype", args[0] if args else None)
        if isinstance(dtype, torch.dtype) and len(args) <= 1 and set(kwargs) <= {"dtype"}:
            return self._with(cast=dtype)
        return self.materialize().to(*args, **kwargs)

    # -- reading --------------------------------------------------------------------------------
    def materialize(self) -> torch.Tensor:
        tensor = self._read(tuple(slice(a, b) for a, b in self._window))
        return tensor if self._cast is None else tensor.to(self._cast)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return func(*materialize(args), **materialize(kwargs or {}))


def _binary(name: str) -> Callable[..., Any]:
    def op(self: CheckpointSlice, *args: Any) -> Any:
        return getattr(self.materialize(), name)(*materialize(args))
    op.__name__ = name
    return op


for _name in ("__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__floordiv__",
              "__and__", "__or__", "__xor__", "__rshift__", "__lshift__", "__neg__", "__eq__", "__ne__", "__lt__",
              "__le__", "__gt__", "__ge__", "__array__"):
    setattr(CheckpointSlice, _name, _binary(_name))
CheckpointSlice.__hash__ = object.__hash__  # __eq__ above would otherwise drop it


def materialize(value: Any) -> Any:
    """`value` with every CheckpointSlice in it (nested in tuples, lists and dicts) read."""
    if isinstance(value, CheckpointSlice):
        return value.materialize()
    if isinstance(value, (tuple, list)):
        return type(value)(materialize(v) for v in value)
    if isinstance(value, dict):
        return {k: materialize(v) for k, v in value.items()}
    return value


def safetensors_slice(handle: Any, name: str, stats: ReadStats) -> CheckpointSlice:
    """A window over tensor `name` of an open `safe_open` handle."""
    piece = handle.get_slice(name)
    shape, dtype = tuple(piece.get_shape()), SAFETENSORS_DTYPES.get(piece.get_dtype())
    if dtype is None:  # a dtype this table does not know: read it whole, as safetensors does
        whole = stats.whole(handle.get_tensor(name))
        return CheckpointSlice(lambda index: whole[index], tuple(whole.shape), whole.dtype)
    stats.stored += torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return CheckpointSlice(_counted(lambda index: piece[index], stats), shape, dtype)


def mapped_slice(tensor: torch.Tensor, stats: ReadStats) -> CheckpointSlice:
    """A window over a tensor `torch.load(mmap=True)` left on disk: only the pages read are touched."""
    stats.stored += _nbytes(tensor)
    return CheckpointSlice(_counted(lambda index: tensor[index], stats), tuple(tensor.shape), tensor.dtype)


def _counted(read: Callable[[tuple[slice, ...]], torch.Tensor],
             stats: ReadStats) -> Callable[[tuple[slice, ...]], torch.Tensor]:
    def counted(index: tuple[slice, ...]) -> torch.Tensor:
        tensor = read(index)
        stats.read += _nbytes(tensor)
        return tensor
    return counted


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
