"""The Cambricon MLU platform over torch_mlu (torch.mlu). The MLU-owned flag kv_cache_dtype
(int8 KV cache) is not built yet, so it is refused at launch."""
from __future__ import annotations

from heterollm.model_executor.device_backend import ExtensionPlatform


class MluPlatform(ExtensionPlatform):
    name = "mlu"
    device_type = "mlu"
    dist_backend = "cncl"
    default_impl = "mlu"
    extension = "torch_mlu"
