"""The Ascend NPU platform over torch_npu (torch.npu). Probing imports torch_npu once, which is
all its vendor allows before a device is used."""
from __future__ import annotations

from heterollm.model_executor.device_backend import ExtensionPlatform


class NpuPlatform(ExtensionPlatform):
    name = "npu"
    device_type = "npu"
    dist_backend = "hccl"
    default_impl = "npu"
    extension = "torch_npu"
