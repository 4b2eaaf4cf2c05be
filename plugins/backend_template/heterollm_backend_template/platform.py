"""The platform: what the device is and how to query it. A real backend wraps its vendor library
here (torch.npu, torch.mlu, ...); the template runs on the host with torch's CPU ops."""
from __future__ import annotations

import os

import torch

from heterollm.interfaces import Platform


class TemplatePlatform(Platform):
    name = "template"
    """What users pass to --device."""
    device_type = "cpu"
    """The torch device string tensors live on (a real backend: "npu", "mlu", its own)."""
    dist_backend = "gloo"
    """torch.distributed backend for tensor parallelism (a real backend: "hccl", "cncl", ...)."""
    default_impl = "template"
    """The component family used when --extension_impl is empty."""

    def is_available(self) -> bool:
        # a real backend: import its vendor library lazily and ask it, without initializing a device
        return True

    def unavailable_reason(self) -> str:
        return ""

    def device_count(self) -> int:
        return 1

    def memory_info(self, device: int = 0) -> tuple[int, int]:
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def set_device(self, rank: int) -> None:
        """One host device; ranks share it."""

    def synchronize(self) -> None:
        """Host ops are synchronous."""

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def supports_dtype(self, dtype: str) -> bool:
        return dtype == "float32"

    def validate(self, config) -> list[str]:
        """Reasons this platform cannot serve `config`: the flags it owns, the dtypes it runs."""
        if config.device.dtype not in ("auto", "float32"):
            return [f"--dtype={config.device.dtype}: the template platform runs float32 only"]
        return []
