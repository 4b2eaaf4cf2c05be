"""The CUDA platform over torch.cuda. Probing asks torch whether CUDA is compiled in and a device
is visible, without creating a context."""
from __future__ import annotations

import torch

from heterollm.interfaces import Platform, TraceProfiler


class CudaPlatform(Platform):
    name = "cuda"
    device_type = "cuda"
    dist_backend = "nccl"
    default_impl = "cuda"

    def is_available(self) -> bool:
        return torch.version.cuda is not None and torch.cuda.is_available()

    def unavailable_reason(self) -> str:
        if torch.version.cuda is None:
            return f"this torch ({torch.__version__}) is built without CUDA"
        if not torch.cuda.is_available():
            return "no CUDA device is visible (driver missing, or CUDA_VISIBLE_DEVICES hides them)"
        return ""

    def device_count(self) -> int:
        return torch.cuda.device_count() if self.is_available() else 0

    def memory_info(self, device: int | None = None) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(torch.cuda.current_device() if device is None else device)
        return int(free), int(total)

    def set_device(self, local_rank: int) -> None:
        torch.cuda.set_device(local_rank % max(1, torch.cuda.device_count()))

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)

    def supports_dtype(self, dtype: str) -> bool:
        if dtype == "bfloat16":
            return torch.cuda.is_bf16_supported()
        return True

    profilers = {
        "torch": "torch.profiler (Kineto): host operators and CUDA kernels, written as a Chrome / Perfetto trace",
        "cuda": "cudaProfilerStart / cudaProfilerStop around the profiled steps: the capture range of an outside "
                "`nsys profile --capture-range=cudaProfilerApi` (no file from heterollm)",
    }

    def profiler_activities(self) -> list:
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]

    def trace_profiler(self, backend: str) -> TraceProfiler:
        return CudaRangeProfiler() if backend == "cuda" else super().trace_profiler(backend)

    def validate(self, config) -> list[str]:
        """The CUDA-owned flags this backend has not built are refused through its descriptor
        (`Backend.unsupported`); nothing else to refuse here."""
        return []


class CudaRangeProfiler(TraceProfiler):
    """`--profile_backend cuda`: marks the capture range of an outside Nsight Systems run."""

    def start(self, stem) -> None:
        torch.cuda.synchronize()
        torch.cuda.profiler.start()

    def stop(self) -> list:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        return []
