"""heterollm's Ascend NPU backend (torch_npu). Import-light (no torch, no torch_npu): the registry
reads `BACKEND.api_version` before it imports any class the descriptor names."""
from heterollm.interfaces.backend import Backend
from heterollm_npu.flags import NPUConfig, VmmConfig

__version__ = "0.1.0"

_UNBUILT = "owned by heterollm-npu but not implemented yet"
_BUILT = {"npu_kernel_backend"}
"""AUTO and TORCH both run the torch kernels, the only ones here."""

BACKEND = Backend(
    name="npu",
    api_version=">=2.0,<3",
    platform="heterollm_npu.platform:NpuPlatform",
    components={
        "attention": "heterollm.model_executor.paged_attention:TorchPagedAttention",
        "graph_runners": "heterollm_npu.components:AclGraphRunner",
        "communicators": "heterollm_npu.components:HcclCommunicator",
        "executors": "heterollm.model_executor.executor:InProcessExecutor",
    },
    flags={"vmm": VmmConfig, "npu": NPUConfig},
    unsupported={
        **{name: _UNBUILT for group in (VmmConfig, NPUConfig) for name in group.model_fields if name not in _BUILT},
        "kv_cache_dtype": "an int8 KV cache is not implemented by heterollm-npu (K/V are stored in the model dtype)",
    },
)
