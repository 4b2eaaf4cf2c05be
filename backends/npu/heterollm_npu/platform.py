"""The Ascend NPU platform over torch_npu (torch.npu). Probing imports torch_npu once, which is
all its vendor allows before a device is used."""
from __future__ import annotations

from pathlib import Path

from heterollm.interfaces import TraceProfiler
from heterollm.profiling import TorchTraceProfiler
from heterollm.model_executor.device_backend import ExtensionPlatform


class NpuPlatform(ExtensionPlatform):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    default_impl = "npu"
    extension = "torch_npu"

    profilers = {"torch": "torch_npu.profiler: host operators, CANN and NPU activity, written as torch_npu's "
                          "result folder (ascend_pt: trace_view.json for Perfetto, plus CANN's tables)"}
    """--profile_backend ascend (CANN's msprof raw capture) is not offered: refused at launch."""

    def trace_profiler(self, backend: str) -> TraceProfiler:
        if backend != "torch":
            return super().trace_profiler(backend)  # names what is offered
        return NpuTraceProfiler()


class NpuTraceProfiler(TorchTraceProfiler):
    """torch_npu's profiler over CPU and NPU; torch_npu writes its own result folder at stop."""

    def __init__(self) -> None:
        super().__init__([])

    def _open(self, stem: Path):
        import torch_npu

        prof = torch_npu.profiler
        return prof.profile(activities=[prof.ProfilerActivity.CPU, prof.ProfilerActivity.NPU],
                            on_trace_ready=prof.tensorboard_trace_handler(str(stem)), record_shapes=True)

    def _written(self, prof, stem: Path) -> list[Path]:
        return [stem]  # the handler wrote the folder when the profiler stopped
