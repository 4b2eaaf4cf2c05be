"""The CPU platform: always available, system memory, gloo collectives."""
from __future__ import annotations

import ctypes
import logging
import os
import platform as host
from typing import TYPE_CHECKING

import torch

from heterollm import envs
from heterollm.interfaces import Platform

if TYPE_CHECKING:
    from heterollm.config import HeterollmConfig

logger = logging.getLogger("heterollm.cpu")


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


M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # glibc's malloc.h
TRIM_BYTES = 1 << 30
_kept: bool | None = None


def keep_freed_memory() -> bool:
    """Have glibc's malloc keep freed memory for the next allocation instead of handing it back to the
    kernel (M_MMAP_MAX 0, M_TRIM_THRESHOLD 1 GiB): called once a CPU engine's weights and KV cache are
    in place. A step's activations above 32 MiB (glibc's largest mmap threshold: an 8,192-token
    prefill's MLP output is 50 MB) were otherwise mmap'd and unmapped at every op, and each first
    touch of their pages faulted: 16K minor faults and ~11 ms of a 60 ms int8 GEMM call on 2 Zen 4
    vCPUs (bench/RESULTS.md, session 23). A free run of more than 1 GiB at the heap's top (a KV cache
    or an engine shut down) is still returned. Not applied where the user chose: HETEROLLM_CPU_KEEP_FREED=0,
    any MALLOC_*_ tunable, or another allocator in LD_PRELOAD (tcmalloc, jemalloc); nor off glibc.
    Returns whether the settings are in force in this process."""
    global _kept
    if _kept is not None:
        return _kept
    _kept = False
    user_set = [k for k in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_",
                            "MALLOC_TOP_PAD_") if k in os.environ]
    if os.environ.get("HETEROLLM_CPU_KEEP_FREED", "1") == "0" or user_set or "malloc" in os.environ.get(
            "LD_PRELOAD", "") or host.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _kept = mallopt(M_MMAP_MAX, 0) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_BYTES) == 1
    if _kept:
        logger.info("malloc keeps freed memory for reuse (M_MMAP_MAX 0, M_TRIM_THRESHOLD 1 GiB; "
                    "HETEROLLM_CPU_KEEP_FREED=0 turns this off)")
    return _kept


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

    def configure_threads(self, num_workers: int, keep_for_server: int = 0) -> None:
        """torch's intra-op pool, split between the workers sharing the host (each tensor-parallel
        rank is a process; data-parallel replicas share this one), less the cores kept for the HTTP
        server: its event loop shares the process with the engine thread, and each request it handles
        would otherwise preempt a pool thread that every op of the step waits for (measured on 2
        cores with vLLM's client at concurrency 4: TPOT 103 ms with 2 threads, 49 ms with 1; vLLM's
        CPU server keeps a core too). OMP_NUM_THREADS, when set, wins."""
        if envs.omp_num_threads() is not None:
            return
        cores = torch.get_num_threads()
        threads = max(1, (cores - keep_for_server) // max(1, num_workers))
        if threads != cores:
            torch.set_num_threads(threads)
            logger.info("torch threads: %d (%d worker(s) on %d cores%s; set OMP_NUM_THREADS to override)", threads,
                        num_workers, cores, f", {keep_for_server} left to the HTTP server" if keep_for_server else "")

    def supports_dtype(self, dtype: str) -> bool:
        if dtype == "float32":
            return True
        flags = _cpu_flags()
        if dtype == "bfloat16":
            return bool({"avx512_bf16", "amx_bf16"} & flags) or "asimdbf16" in flags or "bf16" in flags
        return bool({"avx512_fp16", "amx_fp16"} & flags) or "asimdhp" in flags

    def validate(self, config: HeterollmConfig) -> list[str]:
        return []
