"""The Cambricon MLU platform over torch_mlu (torch.mlu). xLLM's int8 KV cache on MLU
(`--kv_cache_dtype=int8`) is not built yet: the descriptor refuses it at launch."""
from __future__ import annotations

from heterollm.model_executor.device_backend import ExtensionPlatform


class MluPlatform(ExtensionPlatform):
    name = "mlu"
    device_type = "mlu"
    dist_backend = "cncl"
    default_impl = "mlu"
    extension = "torch_mlu"
