"""FastDeploy-only parameters (spec/fastdeploy_params.md) and heterollm's own launch flags.

FastDeploy names that mean the same thing as an xLLM flag are not fields here: they are
aliases declared on the xLLM field (e.g. tensor_parallel_size -> tp_size).
"""
import json
from typing import Any, Optional

from pydantic import field_validator

from heterollm.config.base import FlagGroup, choice, flag

JsonDict = Optional[dict[str, Any]]


class FastDeployConfig(FlagGroup):
    """FastDeploy parameters that have no xLLM counterpart."""

    metrics_port: Optional[int] = flag(None, "Metrics 端口号 (FastDeploy 默认 8001);未设置时 /metrics 只在主端口提供。", ge=1, le=65535)
    max_waiting_time: int = flag(-1, "服务请求建立连接最大等待时间(秒),-1 表示无等待时间限制。", ge=-1)
    engine_worker_queue_port: int = flag(8002, "FastDeploy 内部引擎进程通信端口。", ge=1, le=65535)
    cache_queue_port: int = flag(8003, "FastDeploy 内部 KVCache 进程通信端口。", ge=1, le=65535)
    max_model_len: int = flag(2048, "推理默认最大支持上下文长度 (prompt + 输出 token 数)。", gt=0)
    mm_processor_kwargs: JsonDict = flag(None, "多模态处理器参数配置 (JSON 对象),如 {\"image_min_pixels\": 3136}。")
    tokenizer: Optional[str] = flag(None, "tokenizer 名或路径,默认为模型路径。")
    use_warmup: int = flag(0, "是否在启动时进行 warmup (0/1)。", ge=0, le=1)
    limit_mm_per_prompt: JsonDict = flag(None, "限制每个 prompt 中多模态数据的数量 (JSON 对象),如 {\"image\": 10}。")
    enable_mm: bool = flag(False, "[已废弃] 是否支持多模态数据。")
    quantization: Optional[str] = flag(None, "模型量化策略,如 wint8、wint4 (加载 BF16 权重时在线量化)。")
    num_gpu_blocks_override: Optional[int] = flag(None, "预分配 KVCache 块数;未设置时按显存/内存自动计算。", gt=0)
    kv_cache_ratio: float = flag(0.75, "KVCache 块按该比例分给 Prefill 与 Decode 阶段。", gt=0, le=1)
    swap_space: Optional[float] = flag(None, "开启 Prefix Caching 时用于 swap KVCache 的 CPU 内存大小,单位 GB。", ge=0)
    max_num_partial_prefills: int = flag(1, "开启 Chunked Prefill 时 Prefill 阶段的最大并发数。", gt=0)
    max_long_partial_prefills: int = flag(1, "开启 Chunked Prefill 时 Prefill 并发中最多的长请求数。", gt=0)
    long_prefill_token_threshold: Optional[int] = flag(None, "请求 token 数超过此值被视为长请求,默认 max_model_len*0.04。", gt=0)
    static_decode_blocks: int = flag(2, "每条请求强制从 Prefill 的 KVCache 分配给 Decode 的块数。", ge=0)
    graph_optimization_config: JsonDict = flag(None, "计算图优化参数 (JSON 对象),如 {\"use_cudagraph\": false, \"graph_opt_level\": 0, \"cudagraph_capture_sizes\": null}。")
    splitwise_role: choice("mixed", "decode", "prefill") = flag("mixed", "splitwise 推理角色: mixed、decode、prefill。")
    innode_prefill_ports: Optional[str] = flag(None, "prefill 实例内部引擎启动端口 (仅单机 PD 分离需要)。")
    guided_decoding_backend: choice("auto", "xgrammar", "off") = flag("off", "guided decoding 后端: auto、xgrammar、off。")
    guided_decoding_disable_any_whitespace: bool = flag(False, "guided decoding 期间是否禁止生成空格。")
    speculative_config: JsonDict = flag(None, "投机解码配置 (JSON 对象)。")
    dynamic_load_weight: int = flag(0, "是否动态加载权重 (0/1)。", ge=0, le=1)
    enable_expert_parallel: bool = flag(False, "是否启用专家并行。")
    enable_logprob: bool = flag(False, "是否启用输出 token 返回 logprob。heterollm 总是允许请求 logprobs,此开关只为兼容 FastDeploy 的启动命令。")
    served_model_name: Optional[str] = flag(None, "API 中使用的模型名称,未指定时与 --model 相同。")
    revision: Optional[str] = flag(None, "--model 为 Hugging Face 模型名称时使用的 Git 版本 (分支、tag 或 commit),经 huggingface_hub 缓存解析。")
    chat_template: Optional[str] = flag(None, "chat 模板,字符串或文件路径;未指定时使用模型自带模板。")
    tool_parser_plugin: Optional[str] = flag(None, "要注册的 tool parser 文件路径。")
    load_choices: choice("default", "default_v1") = flag(
        "default", "权重加载器: default (整张量交给 weight loader) 或 default_v1 (内存映射按分片读取: 张量并行时每个 rank 只读取、只转换自己的分片)。")
    runner: choice("auto", "generate", "pooling") = flag("auto", "模型 runner: auto、generate、pooling;pooling 即 xLLM 的 --task embed (embedding 服务)。")
    convert: choice("auto", "none", "embed") = flag("auto", "将生成模型转换为 pooling 模型的方式 (配合 --runner pooling): auto、none、embed。")
    pooler_config: JsonDict = flag(None, "pooling 配置 (JSON 对象),如 {\"pooling_type\": \"MEAN\", \"normalize\": true};pooling_type 取 LAST、MEAN、CLS。")

    @field_validator("mm_processor_kwargs", "limit_mm_per_prompt", "graph_optimization_config",
                     "speculative_config", "pooler_config", mode="before")
    @classmethod
    def _parse_json_object(cls, value: Any) -> Any:
        return parse_json_object(value)


def parse_json_object(value: Any) -> Any:
    """Accept a dict, or a JSON string holding an object (the CLI form)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"is not valid JSON ({exc.msg} at position {exc.pos})") from None
        if not isinstance(value, dict):
            raise ValueError(f"must be a JSON object, got {type(value).__name__}")
    return value


class DeviceConfig(FlagGroup):
    """heterollm's own launch flags: which platform and number format to run with."""

    device: str = flag("auto", "Platform to run on: auto (first available accelerator, CPU last), cpu, cuda, npu, mlu, or a name a vendor wheel registers.")
    dtype: choice("auto", "float32", "bfloat16", "float16") = flag("auto", "Weight and activation dtype; auto = the checkpoint's, bf16 on CPU when it supports it.")
