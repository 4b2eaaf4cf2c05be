"""Helpers for device backends whose vendor library is a torch extension (torch_npu, torch_mlu):
probing it, and a Platform over its `torch.<device>` module. (The flags a backend owns but has not
built are refused through its descriptor's `Backend.unsupported`.)"""
from __future__ import annotations

import importlib
import importlib.util
from typing import Any, ClassVar

from heterollm.interfaces import Platform


def probe_extension(module: str, device_attr: str) -> tuple[Any | None, str]:
    """(torch's device module, "") when `module` imports and reports a device, else (None, why).
    Importing the extension initializes it once, as its vendor allows; nothing more is touched."""
    if importlib.util.find_spec(module) is None:
        return None, f"{module} is not installed"
    try:
        importlib.import_module(module)
    except Exception as exc:  # a broken or mismatched vendor install: say which
        return None, f"{module} failed to import: {exc}"
    import torch

    mod = getattr(torch, device_attr, None)
    if mod is None or not mod.is_available():
        return None, f"{module} is installed but no {device_attr.upper()} device is visible"
    return mod, ""


class ExtensionPlatform(Platform):
    """A Platform whose device module (`torch.npu`, `torch.mlu`) comes from a torch extension
    package. Subclasses set the Platform names plus `extension` (the package).

    bfloat16 is what the device module's `is_bf16_supported()` says (Cambricon's MLU370, for one,
    has none); a module that cannot say is taken not to have it, so `--dtype auto` avoids it and an
    explicit `--dtype bfloat16` is refused at launch rather than failing in a kernel."""

    extension: ClassVar[str]

    def _probe(self) -> tuple[Any | None, str]:
        return probe_extension(self.extension, self.device_type)

    def is_available(self) -> bool:
        return self._probe()[0] is not None

    def unavailable_reason(self) -> str:
        return self._probe()[1]

    def device_count(self) -> int:
        mod, _ = self._probe()
        return mod.device_count() if mod is not None else 0

    def memory_info(self, device: int | None = None) -> tuple[int, int]:
        mod = self._probe()[0]
        free, total = mod.mem_get_info(mod.current_device() if device is None else device)
        return int(free), int(total)

    def set_device(self, local_rank: int) -> None:
        mod, _ = self._probe()
        mod.set_device(local_rank % max(1, mod.device_count()))

    def synchronize(self) -> None:
        self._probe()[0].synchronize()

    def seed(self, seed: int) -> None:
        import torch

        torch.manual_seed(seed)
        self._probe()[0].manual_seed_all(seed)

    def supports_dtype(self, dtype: str) -> bool:
        if dtype != "bfloat16":
            return True
        mod, _ = self._probe()
        ask = getattr(mod, "is_bf16_supported", None)
        return bool(ask()) if callable(ask) else False

    def validate(self, config: Any) -> list[str]:
        problems = []
        if config.device.dtype == "bfloat16" and self.is_available() and not self.supports_dtype("bfloat16"):
            problems.append(f"--dtype=bfloat16: this {self.name.upper()} device has no bfloat16 "
                            f"(torch.{self.device_type}.is_bf16_supported() is not true); use float16")
        return problems
