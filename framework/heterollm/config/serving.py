"""xLLM flag groups for the config file, the server and the model."""

from heterollm.config.base import FlagGroup, Int32, Int64, choice, flag


class ConfigJsonUtilsConfig(FlagGroup):
    """ConfigJsonUtils flags (xLLM)."""

    config_json_file: str = flag("", "JSON 配置文件路径;对于原生配置,显式指定的命令行 flag 优先于文件中的值。")
    enable_dump_config_json: bool = flag(False, "是否将最终生效的启动配置导出为 JSON。")
    dump_config_json_file: str = flag("xllm_config.json", "导出启动配置 JSON 的路径,仅在 enable_dump_config_json=true 时使用。")


class ServerConfig(FlagGroup):
    """server (RPC) flags (xLLM)."""

    host: str = flag("", "bRPC 服务监听的主机名或 IP。")
    port: Int32 = flag(8010, "bRPC 服务监听端口。", ge=1, le=65535)
    rpc_idle_timeout_s: Int32 = flag(-1, "连接在最近 rpc_idle_timeout_s 秒内无读写操作时关闭;-1 表示无限等待。")
    rpc_channel_timeout_ms: Int32 = flag(-1, "bRPC Channel 的最大等待时间,单位毫秒;-1 表示无限等待。")
    max_reconnect_count: Int32 = flag(40, "worker 尝试连接 server 的最大重连次数。")
    num_threads: Int32 = flag(8, "处理请求的线程数。", gt=0)
    max_concurrent_requests: Int32 = flag(200, "实例可同时处理的最大请求数;设为 0 表示不限流。", ge=0, aliases=("max_concurrency",))
    num_request_handling_threads: Int32 = flag(4, "处理输入请求的线程数。")
    num_response_handling_threads: Int32 = flag(4, "处理响应输出的线程数。")
    health_check_interval_ms: Int32 = flag(3000, "worker 健康检查间隔,单位毫秒。", gt=0)


class ModelConfig(FlagGroup):
    """model flags (xLLM)."""

    model_id: str = flag("", "Hugging Face 模型名称,非路径。")
    model: str = flag("", "Hugging Face 模型名称或模型路径。")
    backend: choice("", "llm", "vlm", "dit") = flag("", "后端模型类型;llm 表示纯文本模型,vlm 表示多模态模型,dit 表示扩散模型。")
    task: choice("generate", "embed", "mm_embed") = flag("generate", "模型任务类型,例如 generate、embed、mm_embed。")
    enable_return_embedding_modality_tags: bool = flag(False, "是否在完整序列 embedding 中返回每个 token 的 modality tag。")
    limit_image_per_prompt: Int32 = flag(8, "每个 prompt 允许的最大图片数量,仅用于多模态模型。", ge=0)
    max_encoder_cache_size: Int64 = flag(0, "每个 worker 的 encoder cache 最大显存大小,单位 MB;0 表示禁用 encoder cache。", ge=0)
    reasoning_parser: str = flag("", "reasoning 交互解析器,例如 auto、glm45、glm47、glm5、qwen3、qwen35、deepseek-r1。")
    tool_call_parser: str = flag("", "tool-call 交互解析器,例如 auto、qwen25、qwen3、qwen35、qwen3_coder、kimi_k2、deepseekv3、deepseekv32、deepseekv4、deepseekv41、glm45、glm47、glm5。")
    enable_qwen3_reranker: bool = flag(False, "是否启用 Qwen3 reranker。")
    enable_return_mm_full_embeddings: bool = flag(False, "VLM 模型是否返回 ViT embedding 与序列 embedding。")
    mm_download_headers: str = flag("", "多模态下载的 service 级默认 HTTP header,为 JSON 对象;per-request header 优先级更高。示例:{\"Authorization\":\"Bearer xxx\"}。")
    use_audio_in_video: bool = flag(False, "输入为视频时,是否同时解码音频和视频。")
    audio_max_upload_file_mb: Int32 = flag(25, "语音转文本音频上传大小上限,单位 MiB,必须为正数。", gt=0)
    audio_max_decode_duration_s: Int32 = flag(600, "语音转文本音频解码后的时长上限,单位秒。0 表示不限制。", ge=0)
    use_cpp_chat_template: bool = flag(True, "对支持的模型使用原生 C++ chat template,例如 deepseek_v32、deepseek_v4、deepseek_v41;设为 false 可回退到 Jinja 以便调试。")
