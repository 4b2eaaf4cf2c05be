"""heterollm-cuda's launch flags: the flags only a CUDA device serves (xLLM's piecewise prefill graph,
VMM graph pool and FlashInfer workspace; FastDeploy's custom all-reduce), with the specs' types,
defaults and descriptions. Without this wheel, setting one fails naming heterollm-cuda."""
from heterollm.config.base import FlagGroup, Int32, flag


class CudaConfig(FlagGroup):
    """CUDA-only flags (xLLM execution and model groups; FastDeploy)."""

    enable_prefill_piecewise_graph: bool = flag(False, "是否在 prefill 阶段启用 piecewise CUDA graph;attention 使用 eager 模式,其他操作捕获进 CUDA graph。")
    enable_graph_vmm_pool: bool = flag(True, "是否启用 VMM-backed CUDA graph memory pool,用于多 shape graph 的显存复用。")
    flashinfer_workspace_buffer_size: Int32 = flag(134217728, "FlashInfer split-k attention 中用于保存中间 attention 结果的预留 workspace 大小,默认 128 MiB。", gt=0)
    enable_custom_all_reduce: bool = flag(False, "开启 Custom all-reduce。")
