"""xLLM flag groups for the KV cache and the KV cache store (the NPU-only VMM flags live in heterollm-npu)."""

import json
import re

from pydantic import Field, ValidationError, field_validator

from heterollm.config.base import FlagGroup, Int32, Int64, UInt32, choice, flag


class KVEventsConfig(FlagGroup):
    """The JSON object inside --kv_events_config (validated when the flag is set)."""

    publisher: choice("zmq") = flag("zmq", "发布器类型,当前仅支持 zmq。")
    endpoint: str = Field(..., pattern=r"^tcp://\S+$", description="vLLM 风格 KV 事件的 ZeroMQ 发布基准地址,例如 tcp://*:5557。必须为非空 TCP 地址。")
    replay_endpoint: str = flag("", "快照恢复请求的 ZeroMQ 基准地址,例如 tcp://*:6557;空字符串禁用该入口。恢复回复使用当前全量快照和对应的实时流序号。")
    motor_pool_endpoint: str = flag("", "Motor 本地 Host 副本确认事件的 ZeroMQ 发布基准地址,例如 tcp://*:7557;空字符串禁用该流。")
    topic: str = flag("", "发布的 ZeroMQ topic;消费端的订阅过滤器需要匹配该 topic。")
    hwm: Int32 = flag(10000, "ZeroMQ 发送队列高水位,单位为消息数;必须为正数。", gt=0)
    snapshot_interval_seconds: Int32 = flag(60, "周期性发布全量驻留快照的间隔,单位为秒;必须为正数。", gt=0)

    @field_validator("endpoint", "replay_endpoint")
    @classmethod
    def _check_port(cls, value: str) -> str:
        if value:
            endpoint_port(value)  # raises with the reason
        return value

    @field_validator("motor_pool_endpoint")
    @classmethod
    def _refuse_motor_pool(cls, value: str) -> str:
        if value:
            raise ValueError(f"{KV_EVENTS_REFUSED['motor_pool_endpoint']}; leave it empty")
        return value


KV_EVENTS_REFUSED = {
    "motor_pool_endpoint": "xLLM Motor's host-copy acknowledgement stream has no equivalent in heterollm "
                           "(there is no Motor host pool)",
}
"""JSON fields of --kv_events_config that must stay empty, with the reason (docs/flags.md shows it)."""


_TCP_ENDPOINT = re.compile(r"^tcp://(?P<host>\S+):(?P<port>[^:]+)$")


def endpoint_port(endpoint: str) -> int:
    """The port of a `tcp://host:port` endpoint; a ValueError says why there is none."""
    match = _TCP_ENDPOINT.match(endpoint)
    if match is None:
        raise ValueError(f"must be a TCP endpoint tcp://HOST:PORT, got {endpoint!r}")
    port = match["port"]
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"needs a numeric port in 1-65535 (DP rank r uses port + r), got {endpoint!r}")
    return int(port)


def rank_endpoint(endpoint: str, dp_rank: int) -> str:
    """The endpoint of DP rank `dp_rank`: the base port plus the rank (vLLM's rule)."""
    base = endpoint.rpartition(":")[0]
    return f"{base}:{endpoint_port(endpoint) + dp_rank}"


def kv_events_port_problems(events: KVEventsConfig, dp_size: int) -> list[str]:
    """Launch check of the per-DP-rank ports: rank r publishes on endpoint's port + r and answers
    replay requests on replay_endpoint's port + r, so over ranks 0..dp_size-1 both ranges must
    fit under 65536 and must not overlap (whatever the hosts: `*` binds every interface)."""
    ranges: dict[str, range] = {}
    problems = []
    for name in ("endpoint", "replay_endpoint"):
        value = getattr(events, name)
        if not value:
            continue
        base = endpoint_port(value)
        ranges[name] = range(base, base + dp_size)
        if base + dp_size - 1 > 65535:
            problems.append(f"--kv_events_config: field {name!r}: port {base} + DP rank up to {dp_size - 1} "
                            f"passes 65535")
    if len(ranges) == 2:
        pub, replay = ranges["endpoint"], ranges["replay_endpoint"]
        if pub.start < replay.stop and replay.start < pub.stop:
            problems.append(f"--kv_events_config: field 'replay_endpoint' ports {_span(replay)} overlap field "
                            f"'endpoint' ports {_span(pub)} (DP rank r uses base port + r, dp_size={dp_size})")
    return problems


def _span(ports: range) -> str:
    return str(ports.start) if len(ports) == 1 else f"{ports.start}-{ports.stop - 1}"


class KVCacheConfig(FlagGroup):
    """KV cache flags (xLLM)."""

    block_size: Int32 = flag(128, "每个 KV Cache block 的 slot 数。", gt=0)
    max_cache_size: Int64 = flag(0, "KV Cache 的容量上限,单位 byte;虚拟内存模式下限制 KV 与权重共享池的容量。0 表示不设显式字节上限,根据可用显存推导容量。", ge=0)
    max_memory_utilization: float = flag(0.8, "模型推理可使用的设备显存比例,包括模型权重和 KV Cache。物理 KV Cache 和固定 VMM 要求取值在 (0, 1] 内。弹性 VMM 在启动容量估算、arena 预留和物理页增长时均忽略该比例,容量由实时可用显存和已观察到的执行余量决定。", gt=0, le=1, aliases=("gpu_memory_utilization",))
    kv_cache_dtype: choice("auto", "int8") = flag("auto", "KV Cache 量化数据类型;auto 表示与模型 dtype 对齐且不量化,int8 表示启用 INT8 量化:K/V 以 int8 存储,每个 token、每个 KV head 一个 float32 scale(对称 absmax),KV Cache 字节约减半、block 数约翻倍。heterollm 中由 CPU 后端支持(xLLM 中仅 MLU);MLA 模型不支持。")
    indexer_cache_dtype: choice("auto", "int8") = flag("auto", "带 indexer cache 的模型所使用的 indexer cache 数据类型。支持 auto 和 int8;auto 表示与模型 dtype 对齐且不量化,int8 表示启用 INT8 indexer cache 量化。")
    enable_prefix_cache: bool = flag(True, "是否在 block manager 中启用 prefix cache;详见 Prefix Cache。", aliases=("enable_prefix_caching",))
    kv_events_config: str = flag("", "KV 驻留事件发布配置,为 JSON 对象字符串;空字符串禁用上报。JSON 字段和示例见下文。")
    enable_in_batch_prefix_cache: bool = flag(False, "是否将已准入的 prefill 完整 block 缓存进 prefix cache,使同一 batch 内的后续请求可以共享。")
    max_linear_state_cache_slots: Int64 = flag(0, "linear-attention state cache 的最大活跃槽位数;0 表示根据可用 KV Cache 预算自动推导容量。", ge=0)
    xxh3_128bits_seed: UInt32 = flag(1024, "XXH3 128-bit 哈希的默认 seed。")
    phy_page_granularity_size: Int64 = flag(2097152, "单个物理页的粒度大小,单位 byte,默认 2 MiB;用于连续 KV Cache。", gt=0)

    @field_validator("kv_events_config")
    @classmethod
    def _check_kv_events(cls, value: str) -> str:
        if value:
            try:
                parse_kv_events_config(value)
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"]) or "value"
                raise ValueError(f"field {where!r}: {first['msg'].removeprefix('Value error, ')}") from None
        return value


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """Parse and validate the --kv_events_config JSON object string."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"is not valid JSON ({exc.msg} at position {exc.pos})") from None
    if not isinstance(data, dict):
        raise ValueError(f"must be a JSON object, got {type(data).__name__}")
    return KVEventsConfig.model_validate(data)


class KVCacheStoreConfig(FlagGroup):
    """KV cache store flags (xLLM)."""

    prefetch_timeout: UInt32 = flag(0, "到期后停止下发新的 KV Cache Store 预取批次,并等待在途批次完成;0 表示无限等待。")
    prefetch_batch_size: UInt32 = flag(2, "从 KV Cache Store 预取并拷贝的 batch size。")
    layers_wise_copy_batchs: UInt32 = flag(4, "按层执行 H2D 拷贝的 batch 数。")
    host_blocks_factor: float = flag(0.0, "host block 系数,例如 host block num = host_blocks_factor * hbm block num。", ge=0)
    enable_kvcache_store: bool = flag(False, "是否启用 KV Cache Store。")
    store_protocol: choice("tcp", "rdma") = flag("tcp", "KV Cache Store 协议,例如 tcp、rdma。")
    store_rdma_devices: str = flag("", "xLLM Worker 内嵌 Store client 使用的 RDMA HCA 列表,多个设备以逗号分隔;空值表示由 Mooncake 自动发现。")
    store_master_server_address: str = flag("", "Store master 地址。单机模式使用 IP:Port;etcd 高可用模式使用 etcd://IP:Port;IP:Port;...。")
    store_metadata_server: str = flag("", "KV Cache Store metadata service 的地址。")
    store_local_hostname: str = flag("", "KV Cache Store client 的本地主机名。")
    enable_control_h2d_block_num: bool = flag(False, "是否控制 H2D 拷贝的 block 数。")
