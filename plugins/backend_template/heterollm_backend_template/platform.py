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

    def memory_info(self, device: int | None = None) -> tuple[int, int]:
        """(free, total) bytes of host memory (one host device: `device` is ignored). A real backend
        asks its vendor library about `device`, or about the current device when None, never a
        fixed index: each tensor-parallel rank has its own device."""
        page = os.sysconf("SC_PAGE_SIZE")
        return os.sysconf("SC_AVPHYS_PAGES") * page, os.sysconf("SC_PHYS_PAGES") * page

    def set_device(self, local_rank: int) -> None:
        """One host device; ranks share it. A real backend binds `local_rank % device_count()`."""

    def synchronize(self) -> None:
        """Host ops are synchronous."""

    def seed(self, seed: int) -> None:
        """Host generators; a real backend seeds its device's too (`torch.<device>.manual_seed_all`)."""
        torch.manual_seed(seed)

    def supports_dtype(self, dtype: str) -> bool:
        """float32 only. A real backend asks its vendor library (e.g. `is_bf16_supported()`) rather
        than assuming: some chips of a family lack bf16."""
        return dtype == "float32"

    def validate(self, config) -> list[str]:
        """Reasons this platform cannot serve `config`: the flags it owns, the dtypes it runs."""
        if config.device.dtype not in ("auto", "float32"):
            return [f"--dtype={config.device.dtype}: the template platform runs float32 only"]
        return []
