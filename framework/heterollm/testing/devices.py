"""Catch code that mixes tensors of two devices, without the device: a checker for tests.

Code that builds a tensor on the CPU and combines it with a tensor on an accelerator runs fine on
a CPU-only machine and crashes on the first request on the device ("Expected all tensors to be on
the same device"). `DeviceMixingDetector` makes that mistake fail on the CPU.

API
    DeviceMixingError                  raised when one op mixes devices (an AssertionError).
    DeviceMixingDetector(fake="meta")  a context manager (a TorchDispatchMode plus a
                                       TorchFunctionMode). Inside it:
        detector.place(t)              the CPU tensor `t`, presented as living on the fake
                                       device: its `.device` is `fake`, its data stays on the CPU
                                       so the code under test really runs (masks, `.tolist()`,
                                       `bool(...)`, in-place random draws with CPU generators);
        detector.ops                   the names of the ops seen (`"aten.exponential_.default"`),
                                       to assert that the code path under test actually ran.
    DeviceMixingDetector(fake=None)    checks real devices only (for a machine with a device).

Inside the detector, every op checks the devices of all its tensor operands (arguments, lists of
arguments, keyword arguments): a placed tensor counts as the fake device, any other tensor as
its own device. CPU tensors PyTorch itself lets mix are exempt: zero-dimensional ones (scalars),
the indices of advanced indexing (`t[cpu_index]`) and the source of `copy_`. Two different devices
among the rest raise `DeviceMixingError` naming the op.

Tensors are created on the fake device the ways device code creates them: a factory with
`device=` the fake device (`torch.tensor`, `torch.full`, `torch.zeros`, ...), `.to(fake)`, and
every op whose inputs include a placed tensor (`new_*`, `*_like`, views, arithmetic). Results
moved to the CPU (`.to("cpu")`, `.cpu()`) come back as plain tensors. A real tensor on the fake
device's type that appears inside the detector (made by a path it does not intercept) raises
too, since it would carry no data. Generators are not checked: the code under test gets
whatever generator the test hands it.

    with DeviceMixingDetector() as dev:
        tokens, _ = Sampler()(dev.place(torch.randn(2, 8)), rows)
    assert "aten.exponential_.default" in dev.ops
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["DeviceMixingError", "DeviceMixingDetector"]


class DeviceMixingError(AssertionError):
    """One op received tensors on two different devices."""


class _OnFakeDevice(torch.Tensor):
    """A CPU tensor (`elem`) that reports another device; only meaningful inside the detector."""

    elem: torch.Tensor

    @staticmethod
    def __new__(cls, elem: torch.Tensor, device: torch.device) -> _OnFakeDevice:
        out = torch.Tensor._make_wrapper_subclass(
            cls, elem.shape, strides=elem.stride(), storage_offset=elem.storage_offset(),
            dtype=elem.dtype, layout=elem.layout, device=device, requires_grad=elem.requires_grad)
        out.elem = elem
        return out

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func}: a tensor placed on a fake device was used outside its DeviceMixingDetector")

    def __repr__(self) -> str:
        return f"OnFakeDevice(device={self.device}, {self.elem!r})"


class DeviceMixingDetector:
    """Raise `DeviceMixingError` on any op that mixes devices; see the module docstring."""

    def __init__(self, fake: str | torch.device | None = "meta") -> None:
        self.fake = torch.device(fake) if fake is not None else None
        self.ops: set[str] = set()
        self._dispatch = _DispatchMode(self)
        self._function = _FunctionMode(self)

    def __enter__(self) -> DeviceMixingDetector:
        self._function.__enter__()
        self._dispatch.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._dispatch.__exit__(*exc)
        self._function.__exit__(*exc)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """`t` (a CPU tensor) as if it lived on the fake device; shares `t`'s data."""
        if self.fake is None:
            raise ValueError("place() needs a fake device: DeviceMixingDetector(fake='meta')")
        if t.device.type != "cpu":
            raise ValueError(f"place() takes a CPU tensor, got one on {t.device}")
        return _OnFakeDevice(t, self.fake)

    # -- used by the two modes ---------------------------------------------------------------------
    def is_fake(self, device: object) -> bool:
        """Whether a `device=` argument names the fake device."""
        if self.fake is None or device is None:
            return False
        return torch.device(device).type == self.fake.type  # type: ignore[arg-type]

    def check(self, op: str, operands: Sequence[object], exempt: frozenset[int] = frozenset()) -> None:
        """Raise `DeviceMixingError` when the tensors among `operands` sit on two devices (those
        whose id is in `exempt` may be on the CPU)."""
        devices: set[str] = set()
        for t in operands:
            if not isinstance(t, torch.Tensor):
                continue
            if isinstance(t, _OnFakeDevice):
                devices.add(str(t.device))
                continue
            if self.fake is not None and t.device.type == self.fake.type:
                raise DeviceMixingError(f"{op}: a real tensor on {t.device} (it has no data here); create "
                                        "device tensors with device=... or .to(device)")
            if t.device.type == "cpu" and (t.dim() == 0 or id(t) in exempt):
                continue  # PyTorch lets zero-dimensional CPU tensors mix as scalars, and CPU indices
            devices.add(str(t.device))
        if len(devices) > 1:
            raise DeviceMixingError(f"{op} mixes tensors on {', '.join(sorted(devices))}")

    def wrap(self, out: object) -> object:
        """Every CPU tensor in `out`, placed on the fake device."""
        return tree_map(lambda t: _OnFakeDevice(t, self.fake) if _plain(t) else t, out)


def _plain(t: object) -> bool:
    return isinstance(t, torch.Tensor) and not isinstance(t, _OnFakeDevice) and t.device.type == "cpu"


def _unwrap(t: object) -> object:
    return t.elem if isinstance(t, _OnFakeDevice) else t


class _DispatchMode(TorchDispatchMode):
    """Checks every aten op; runs ops on placed tensors on their CPU data and re-places results."""

    def __init__(self, detector: DeviceMixingDetector) -> None:
        super().__init__()
        self.detector = detector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        det = self.detector
        det.ops.add(str(func))
        operands, _ = tree_flatten((args, kwargs))
        det.check(str(func), operands, _cpu_indices(func, args))
        to_fake = det.is_fake(kwargs.get("device"))
        if to_fake:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        placed = [t for t in operands if isinstance(t, _OnFakeDevice)]
        out = func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if func is torch.ops.aten._to_copy.default and kwargs.get("device") is not None and not to_fake:
            return out  # an explicit copy off the device (to the CPU)
        if func is torch.ops.aten._local_scalar_dense.default or not (placed or to_fake):
            return out
        return _rewrap(det, out, placed)


_INDEX_OPS = (torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default,
              torch.ops.aten._index_put_impl_.default)


def _cpu_indices(func: object, args: tuple) -> frozenset[int]:
    """Ids of the operands PyTorch lets sit on the CPU: the index tensors of an advanced-indexing
    op (it moves them itself) and the source of `copy_` (a copy between devices)."""
    if func is torch.ops.aten.copy_.default and len(args) >= 2:
        return frozenset({id(args[1])})
    if func not in _INDEX_OPS or len(args) < 2:
        return frozenset()
    return frozenset(id(t) for t in args[1] if isinstance(t, torch.Tensor))


def _rewrap(det: DeviceMixingDetector, out: object, placed: list[_OnFakeDevice]) -> object:
    """Placed versions of `out`'s tensors; an in-place or out= result keeps its original wrapper."""
    by_elem = {id(t.elem): t for t in placed}

    def one(t: object) -> object:
        if isinstance(t, torch.Tensor) and id(t) in by_elem:
            return by_elem[id(t)]
        return det.wrap(t)

    return tree_map(one, out)


class _FunctionMode(TorchFunctionMode):
    """Catches factories that never reach the dispatcher with their device (`torch.tensor(...,
    device=fake)`, `Tensor.new_tensor`): builds them on the CPU and places the result."""

    def __init__(self, detector: DeviceMixingDetector) -> None:
        super().__init__()
        self.detector = detector

    def __torch_function__(self, func: Callable, types, args=(), kwargs: Mapping | None = None):
        kwargs = dict(kwargs or {})
        det = self.detector
        if det.is_fake(kwargs.get("device")) and func is not torch.Tensor.to:
            kwargs["device"] = torch.device("cpu")
            return det.wrap(func(*args, **kwargs))
        placed_self = bool(args) and isinstance(args[0], _OnFakeDevice)
        if func is torch.Tensor.new_tensor and placed_self and "device" not in kwargs:
            return det.wrap(func(args[0].elem, *args[1:], **kwargs))
        if func in _TO_HOST and placed_self:
            return func(args[0].elem, *args[1:], **kwargs)  # a copy to the host, as on a device
        if func in _INDEXING and placed_self:
            # `t[[0, 2]]` builds its index tensor on t's device inside C++, out of the modes' sight
            return func(args[0], _place_lists(det, args[1]), *args[2:], **kwargs)
        return func(*args, **kwargs)


_INDEXING = (torch.Tensor.__getitem__, torch.Tensor.__setitem__)
_TO_HOST = (torch.Tensor.tolist, torch.Tensor.numpy)


def _place_lists(det: DeviceMixingDetector, index: object) -> object:
    """An indexing expression with each list of ints or bools made a placed tensor."""
    if isinstance(index, tuple):
        return tuple(_place_lists(det, i) for i in index)
    if isinstance(index, list) and all(isinstance(i, (bool, int)) for i in index):
        return det.place(torch.tensor(index) if index else torch.tensor([], dtype=torch.long))
    return index

