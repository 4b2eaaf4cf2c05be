"""heterollm's CUDA backend. Import-light (no torch): the registry reads `BACKEND.api_version`
before it imports any class the descriptor names."""
from heterollm.interfaces.backend import Backend
from heterollm_cuda.flags import CudaConfig

__version__ = "0.1.0"

_UNBUILT = "owned by heterollm-cuda but not implemented yet"

BACKEND = Backend(
    name="cuda",
    api_version=">=2.0,<3",
    platform="heterollm_cuda.platform:CudaPlatform",
    components={
        "attention": "heterollm_cuda.attention:CudaPagedAttention",
        "graph_runners": "heterollm_cuda.graph_runner:CudaGraphRunner",
        "communicators": "heterollm_cuda.communicator:NcclCommunicator",
        "executors": "heterollm.model_executor.executor:InProcessExecutor",
    },
    flags={"cuda": CudaConfig},
    unsupported={
        **dict.fromkeys(["enable_prefill_piecewise_graph", "enable_graph_vmm_pool", "flashinfer_workspace_buffer_size",
                         "enable_custom_all_reduce"], _UNBUILT),
        "kv_cache_dtype": "an int8 KV cache is not implemented by heterollm-cuda (K/V are stored in the model dtype)",
    },
)
