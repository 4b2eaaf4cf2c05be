"""heterollm-npu's launch flags: the xLLM flags only an Ascend NPU serves, with the spec's types,
defaults and descriptions. They join the config when this wheel is installed (`config.vmm.*`,
`config.npu.*`); without it, setting one fails naming heterollm-npu."""
from heterollm.config.base import FlagGroup, Int32, Int64, choice, flag


class VmmConfig(FlagGroup):
    """weight loading / VMM (NPU) flags (xLLM), with the KV cache's VMM flags."""

    enable_vmm_weights: bool = flag(False, "为模型权重启用 VMM。与 enable_vmm_kvcache 独立,仅 NPU 支持。")
    enable_rolling_load: bool = flag(False, "使用固定数量的 HBM 槽位按层加载 DiT 权重,仅 NPU 支持。")
    rolling_load_num_cached_layers: Int32 = flag(2, "enable_rolling_load=true 时 HBM 中保留的 decoder layer 权重槽位数量。", ge=0)
    rolling_load_num_rolling_slots: Int32 = flag(-1, "decoder rolling load 使用的 rolling 槽位数量;固定槽位数为 rolling_load_num_cached_layers - rolling_load_num_rolling_slots。-1 表示自动设置为 min(2, preload_count),取值需在 [-1, rolling_load_num_cached_layers] 范围内。", ge=-1)
    enable_vmm_kvcache: bool = flag(False, "为 KV Cache 启用 VMM,与 enable_vmm_weights 独立;false 使用原有物理 KV Cache 实现,仅 NPU 支持。")
    enable_shared_kv_cache: bool = flag(False, "target Full KV、Linear state extents 与兼容的 Full-only MTP draft KV 共享固定物理 arena。target/draft 使用不同 bank 视图及相同最终页号,Linear state 可复用 draft bank 空间。draft Full 行几何须与 target 一致,draft 层数须能填满 companion bank。原生 NPU Torch Qwen hybrid 路径仍限普通 eager;Python 路径支持 eager/chunked prefill、ACL decode/verify 和普通 Qwen3.5/3.8 MTP。")
    vmm_elastic: bool = flag(True, "任一 VMM 开关启用后,按需扩张活动逻辑槽位及物理页,并释放空闲页的物理内存;false 使用固定驻留池。")
    vmm_memory_reserve_bytes: Int64 = flag(0, "弹性虚拟内存增长时额外保留的设备空闲显存,单位 byte,须非负;在运行时执行预留空间之外叠加生效。", ge=0)
    vmm_startup_timeout_ms: Int32 = flag(120000, "VMM 启动时,master 等待节点注册、各非 master 等待物理池就绪分别使用的超时,单位毫秒,须为正数。独立于单次 RPC 超时,每个等待阶段单独计时。", gt=0)


class NPUConfig(FlagGroup):
    """NPU flags (xLLM), with the NPU-only flags of the parallel, EPLB and execution groups."""

    npu_kernel_backend: choice("AUTO", "TORCH") = flag("AUTO", "NPU kernel 后端,支持 AUTO、TORCH。")
    enable_fused_mc2: Int32 = flag(-1, "NPU 的 Fused MC2 模式;-1 使用自动默认值,0 禁用 fused MC2,正值启用 dense matmul-allreduce,1 对 MoE 使用 DispatchFFNCombine,2 对 MoE 使用 DispatchGmmCombineDecode。", ge=-1, le=2)
    enable_dspark_native_sas: bool = flag(False, "启用 NPU DSpark 原生 SparseAttnSharedkv 语义。旧版算子若不接受非空 ori_sparse_indices,可能在 tiling 阶段终止进程;请保持关闭以使用 q_len=1 兼容模式。")
    communication_backend: choice("hccl", "lccl") = flag("hccl", "NPU 通信后端,例如 lccl、hccl;启用 DP 时使用 hccl。")
    enable_multi_stream_parallel: bool = flag(False, "是否在 prefill 阶段通过双 stream 和双 micro batch 启用计算通信并行;详见 多流并行。")
    micro_batch_num: Int32 = flag(1, "多流并行使用的 micro batch 数。", ge=1)
    rank_tablefile: str = flag("", "ATB HCCL rank table 文件。")
    enable_graph_double_buffer: bool = flag(True, "是否为 NPU schedule-overlap decode 启用双缓冲 ACL graph 持久化参数与 graph 实例。")
    acl_graph_decode_batch_size_limit: Int32 = flag(16, "NPU 上 ACL graph 的 decode batch size 阈值;实际 decode batch size 超过该值时,ACL graph decode 会回退到 eager 模式以避免 OOM。", gt=0)
    block_draft_graph_warmup_max_kv_len: Int32 = flag(0, "仅为 Python block draft 的独立 ACL graph(DSpark/DFlash2,包括 GLM MLA draft)预捕获按 2 的幂增长的 KV 容量桶。0 覆盖完整模型上下文;正数预捕获到覆盖该长度的容量桶;-1 保留按需捕获。已有 warmup 必需的形状始终保留,即使超过正数上限。超过预捕获上界的请求仍可在线扩桶。更多容量桶会增加启动时间和 draft 图显存占用;不改变 target、MTP、context-write 或可选整轮 unified graph 的预热策略。", ge=-1)
