"""xLLM flag groups for the scheduler, speculative decoding and profiling."""

from pydantic import field_validator

from heterollm.config.base import INT32_MAX, FlagGroup, Int32, choice, flag


class SchedulerConfig(FlagGroup):
    """scheduler flags (xLLM)."""

    max_tokens_per_batch: Int32 = flag(10240, "每个 batch 可处理的最大 token 数。", gt=0, aliases=("max_num_batched_tokens",))
    max_seqs_per_batch: Int32 = flag(200, "每个 batch 可处理的最大 sequence 数。", gt=0, aliases=("max_num_seqs",))
    enable_schedule_overlap: bool = flag(False, "是否启用 schedule overlap(异步调度);详见 异步调度。")
    prefill_scheduling_memory_usage_threshold: float = flag(0.95, "prefill 调度时的内存使用阈值。", gt=0, le=1)
    enable_chunked_prefill: bool = flag(True, "是否启用 chunked prefill。")
    max_tokens_per_chunk_for_prefill: Int32 = flag(-1, "prefill 阶段每个 chunk 的最大 token 数;-1 表示使用默认策略。", ge=-1)
    chunked_match_frequency: Int32 = flag(2, "sequence prefix cache 匹配频率。", gt=0)
    priority_strategy: choice("fcfs", "priority", "deadline") = flag("fcfs", "请求优先级策略,例如 fcfs、priority、deadline。")
    enable_mix_batch: bool = flag(True, "是否在同一 batch 中运行 prefill 和 decode。启用 CP 或 MTP 时会被强制设为 false。")
    aggressive_coeff: float = flag(1.0, "MixScheduler 紧急度判断的激进系数。", gt=0)
    starve_threshold: float = flag(1.0, "MixScheduler 的饥饿阈值系数。", gt=0)
    enable_starve_prevent: bool = flag(True, "是否启用 MixScheduler 的防饥饿机制。")
    enable_dp_fair_token_budget: bool = flag(True, "是否在 PD 分离的 PREFILL 实例上把每个 DP group 每轮调度的 token 数限制为 max_tokens_per_batch / dp_size(下限为一个 prefill chunk)。")
    request_queue_size: Int32 = flag(100000, "调度器请求队列容量;队列满时新到的请求会在准入阶段被拒绝。", gt=0)


    @field_validator("max_tokens_per_chunk_for_prefill")
    @classmethod
    def _check_chunk(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (default policy) or a positive token count")
        return value


class SpeculativeConfig(FlagGroup):
    """speculative decoding flags (xLLM)."""

    draft_model: str = flag("", "draft 模型路径;MTP 使用方式详见 MTP。")
    num_speculative_tokens: Int32 = flag(0, "每轮 speculative decoding 生成的 speculative token 数。", ge=0)
    speculative_algorithm: choice("MTP", "Eagle3", "Suffix", "DFlash", "DFlash2", "DSpark", "ngram", "draft_model") = flag("MTP", "Speculative decoding 算法,支持 MTP、Eagle3、Suffix、DFlash、DFlash2(仅 NPU)、DSpark;heterollm 另有 ngram (prompt lookup) 与 draft_model (--draft_model 给出的同词表小模型)。")
    speculative_suffix_cache_max_depth: Int32 = flag(64, "Suffix speculative decoding 的后缀树最大深度。", gt=0)
    speculative_suffix_max_cached_requests: Int32 = flag(-1, "Suffix speculation 全局最大缓存请求数;-1 表示不限,0 表示禁用。", ge=-1)
    speculative_suffix_use_tree_spec: bool = flag(False, "是否使用 tree-based suffix speculation,而不是 path speculation。")
    enable_probabilistic_draft: bool = flag(False, "draft 从自身分布采样 proposal(携带 q 供拒绝采样)。默认为 greedy argmax。仅 MTP、DSpark、DFlash2、Eagle3 支持。")


class ProfileConfig(FlagGroup):
    """profile flags (xLLM)."""

    enable_profile_step_time: bool = flag(False, "是否启用 step time profiling。")
    enable_profile_token_budget: bool = flag(False, "是否启用 token budget profiling。")
    enable_latency_aware_schedule: bool = flag(False, "是否使用预测 latency 进行 latency-aware schedule。")
    profile_max_prompt_length: Int32 = flag(2048, "profiling 使用的最大 prompt 长度。", gt=0)
    max_global_ttft_ms: Int32 = flag(INT32_MAX, "全局 TTFT 阈值,单位毫秒。", gt=0)
    max_global_tpot_ms: Int32 = flag(INT32_MAX, "全局 TPOT 阈值,单位毫秒。", gt=0)
    enable_profile_kv_blocks: bool = flag(True, "profiling 时是否生成 KV Cache blocks。")
    disable_ttft_profiling: bool = flag(False, "是否禁用 TTFT profiling。")
    enable_online_profile: bool = flag(False, "是否启用在线 timeline 接口(/start_profile 和 /stop_profile),支持 Ascend NPU 及文档中列出的 profiling 后端。")
    profile_backend: str = flag("torch", "在线 profiling 后端。torch(默认)在 Ascend 上通过 torch_npu 采集 CPU+NPU,在其他支持的平台通过 Kineto 采集 CPU+CUDA;ascend 采集 CANN 原始数据,使用 msprof 导出;cuda 控制外部 nsys 的 capture range。部署限制见在线服务性能分析。可用取值由所选平台提供 (Platform.profilers),其余在启动时拒绝。")
    profile_dir: str = flag("", "torch 和 ascend 后端的 trace 输出目录;为空表示当前工作目录。")
