"""xLLM flag groups for execution (graphs, shm, seed) and DiT (NPU-only and CUDA-only flags live in
those backends' wheels)."""

from heterollm.config.base import FlagGroup, Int32, Int64, UInt64, choice, flag


class ExecutionConfig(FlagGroup):
    """execution flags (xLLM)."""

    extension_impl: str = flag("", "为模型、执行器等注册组件选择原生扩展实现族;空值保留原有选择方式。所选实现族必须已注册;该实现族未注册的组件继续使用原有选择方式。")
    enable_graph: bool = flag(False, "是否在 decode 阶段启用图执行以降低 kernel launch 开销和设备空闲时间;支持 CUDA Graph、ACL Graph(NPU)、MLU Graph 和 DCU Graph,详见 图执行。", aliases=("use_cudagraph",))
    enable_graph_mode_decode_no_padding: bool = flag(False, "decode 阶段是否按实际 num_tokens 捕获 graph,而不是按 padding 后 shape 捕获。")
    max_tokens_for_graph_mode: Int32 = flag(2048, "图执行最大 token 数;0 表示不限制。", ge=0)
    enable_shm: bool = flag(False, "是否为模型执行启用共享内存。")
    use_contiguous_input_buffer: bool = flag(True, "是否使用连续的 device input buffer 执行模型。")
    input_shm_size: UInt64 = flag(1024, "输入共享内存大小,默认 1GB。")
    output_shm_size: UInt64 = flag(128, "输出共享内存大小,默认 128MB。")
    random_seed: Int32 = flag(-1, "随机数生成器 seed;-1 表示不固定 seed。", ge=-1)
    enable_dsa_multi_stream: bool = flag(False, "为 Python GLM indexer 启用局部并行:K/weights 投影在辅助流执行,query/cache 行相同时保留融合投影;主流同步后再更新 index cache。非 interleaved RoPE 还可并行 Q 投影/RoPE 与 cache 准备。主 attention 准备完成后才执行 indexer。要求模型后端和设备流能力均受支持。")
    enable_attn_dp_weight_sharding: bool = flag(False, "在 Python GLM MLA 中,将依赖 attention head 的权重按 TP × DP 切分。要求 DP > 1、CP = 1、layerwise split = 1,attention head 数能被 TP × DP 整除。每个 token owner 仍执行普通 TP 的本地 heads,每层使用三次通信;MoE 使用独立的 MoE TP/EP 分组。")


class DiTConfig(FlagGroup):
    """DiT flags (xLLM)."""

    max_requests_per_batch: Int32 = flag(1, "每个 batch 的最大 request 数。", gt=0)
    dit_cache_policy: choice("None", "FBCache", "TaylorSeer", "FBCacheTaylorSeer", "ResidualCache") = flag("TaylorSeer", "DiT cache 策略,例如 None、FBCache、TaylorSeer、FBCacheTaylorSeer、ResidualCache。")
    dit_cache_warmup_steps: Int64 = flag(0, "warmup step 数量。")
    dit_cache_n_derivatives: Int64 = flag(3, "TaylorSeer 使用的 derivative 数量。", ge=0)
    dit_cache_skip_interval_steps: Int64 = flag(3, "TaylorSeer 和 ResidualCache 的刷新间隔,必须大于 0。对 TaylorSeer,1 表示每步都计算;其他策略不使用此参数。", gt=0)
    dit_cache_residual_diff_threshold: float = flag(0.09, "cache reuse 的 residual difference 阈值。")
    dit_cache_start_steps: Int64 = flag(5, "起始阶段跳过的 step 数。")
    dit_cache_end_steps: Int64 = flag(5, "末尾阶段跳过的 step 数。")
    dit_cache_start_blocks: Int64 = flag(5, "起始阶段跳过的 block 数。")
    dit_cache_end_blocks: Int64 = flag(5, "末尾阶段跳过的 block 数。")
    dit_sp_communication_overlap: bool = flag(True, "是否为 sequence parallel 启用通信与计算的 overlap。")
    dit_debug_print: bool = flag(False, "是否打印 DiT 模型 debug 信息。")
    dit_generation_image_area_max: Int64 = flag(0, "图像生成请求允许的最大图像面积(宽 * 高);0 表示不限制。", ge=0)
    dit_h3_task_type: choice("fl2va", "ref2va") = flag("fl2va", "MiniMax-H3 任务类型:fl2va 或 ref2va。")
    dit_enable_vae_tiling: bool = flag(False, "是否启用 VAE tiling,目前仅支持 qwen-image-edit-plus。")
    dit_vae_image_size: Int64 = flag(1048576, "Qwen-Image-Edit-Plus VAE 用于计算维度的 image size。", gt=0)
    dit_sparse_attention_enabled: bool = flag(False, "是否为 WAN 启用 block-wise sparse attention / RainFusion。")
    dit_sparse_attention_sparsity: float = flag(0.5, "sparse attention 稀疏度,取值 [0.0, 1.0);0.0 表示 dense attention,0.5 表示丢弃 50% 的 block。", ge=0, lt=1)
    dit_sparse_attention_pool_size: Int64 = flag(128, "block-wise mask 生成时 sparse attention 的 pooling 窗口大小。", gt=0)
    dit_sparse_attention_sparse_start_step: Int64 = flag(0, "开始使用 sparse attention 的 step 索引;此前的 step 使用 dense attention。")
    dit_sparse_attention_version: choice("rain_fusion", "sparse_attention") = flag("rain_fusion", "sparse attention 版本:rain_fusion(frame-pairing + aclnnRainFusionAttention)或 sparse_attention(block-decompose + aclnnBlockSparseAttention)。")
    dit_sparse_attention_mask_refresh_steps: Int64 = flag(1, "每 N 个 diffusion step 重新计算一次 block sparse mask;1 表示每步都算,值越大 mask 复用越久。", gt=0)
