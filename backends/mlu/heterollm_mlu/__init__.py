"""heterollm's Cambricon MLU backend (torch_mlu). Import-light (no torch, no torch_mlu): the registry
reads `BACKEND.api_version` before it imports any class the descriptor names."""
from heterollm.interfaces.backend import Backend

__version__ = "0.1.0"

BACKEND = Backend(
    name="mlu",
    api_version=">=2.0,<3",
    platform="heterollm_mlu.platform:MluPlatform",
    components={
        "attention": "heterollm.model_executor.paged_attention:TorchPagedAttention",
        "graph_runners": "heterollm_mlu.components:MluGraphRunner",
        "communicators": "heterollm_mlu.components:CnclCommunicator",
        "executors": "heterollm.model_executor.executor:InProcessExecutor",
    },
    unsupported={
        "kv_cache_dtype": "xLLM's int8 KV cache on MLU is not implemented by heterollm-mlu yet (K/V are stored in "
                          "the model dtype)",
    },
)
