"""The CPU platform: always available, system memory, gloo collectives."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from heterollm.interfaces import Platform

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig


def _meminfo() -> dict[str, int]:
    out = {}
    try:
        with open("/proc/meminfo", encoding="ascii") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith(("flags", "Features")):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


class CpuPlatform(Platform):
    name = "cpu"
    device_type = "cpu"
    dist_backend = "gloo"
    default_impl = "cpu"
    idle_kv_budget_bytes = 1 << 30
    """The default KV reservation is most of RAM but committed page by page: cached prefixes keep at
    most 1 GiB of it beyond the working set, unless the user sizes the cache."""

    def is_available(self) -> bool:
        return True

    def unavailable_reason(self) -> str:
        return ""

    def device_count(self) -> int:
        return 1

    def memory_info(self, device: int | None = None) -> tuple[int, int]:
        """System memory (one CPU device: `device` is ignored)."""
        info = _meminfo()
        if "MemTotal" in info:
            return info.get("MemAvailable", info.get("MemFree", 0)), info["MemTotal"]
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        free = os.sysconf("SC_AVPHYS_PAGES") * size
        return free, pages * size

    def set_device(self, local_rank: int) -> None:
        """One CPU device; ranks share it."""

    def synchronize(self) -> None:
        """CPU ops are synchronous."""

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def supports_dtype(self, dtype: str) -> bool:
        if dtype == "float32":
            return True
        flags = _cpu_flags()
        if dtype == "bfloat16":
            return bool({"avx512_bf16", "amx_bf16"} & flags) or "asimdbf16" in flags or "bf16" in flags
        return bool({"avx512_fp16", "amx_fp16"} & flags) or "asimdhp" in flags

    def validate(self, config: HeterollmConfig) -> list[str]:
        return []
