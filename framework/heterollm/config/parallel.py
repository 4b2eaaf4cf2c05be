"""xLLM flag groups for parallelism, EPLB, multi-node and PD disaggregation (NPU-only flags of these
groups live in heterollm-npu)."""

from heterollm.config.base import FlagGroup, Int32, Int64, choice, flag


class ParallelConfig(FlagGroup):
    """parallel flags (xLLM)."""

    dp_size: Int32 = flag(1, "MLA attention 的 data parallel 规模。", ge=1, aliases=("data_parallel_size",))
    ep_size: Int32 = flag(1, "MoE 模型的 expert parallel 规模。", ge=1)
    cp_size: Int32 = flag(1, "Context parallel 规模,需要后端和模型支持;设为 1 表示禁用 context parallel。", ge=1)
    kv_split_size: Int32 = flag(1, "KV Cache split 宽度;0 表示沿用 cp_size(旧行为),1 表示不切分 KV(每个 CP rank 存储完整 KV 并跳过 prefix AllGather),其他可整除 cp_size 的 K 表示 KV 在 K 个 rank 间分片,而 token-CP 仍使用 cp_size。", ge=0)
    tp_size: Int64 = flag(1, "Tensor parallel 规模,仅 DiT 模型使用。", ge=1, aliases=("tensor_parallel_size",))
    sp_size: Int64 = flag(1, "Sequence parallel 规模,仅 DiT 模型使用。", ge=1)
    cfg_size: Int64 = flag(1, "Classifier-free guidance parallel 规模,仅 DiT 模型使用。", ge=1)
    vae_size: Int64 = flag(1, "VAE patch parallel 规模,仅 DiT 模型使用。", ge=1)
    enable_mm_encoder_dp: bool = flag(False, "是否为多模态模型启用 encoder data parallel。")


class EplbConfig(FlagGroup):
    """EPLB (MoE) flags (xLLM)."""

    enable_eplb: bool = flag(False, "是否启用 expert parallel load balance;详见 EPLB。")
    redundant_experts_num: Int32 = flag(1, "每个 device 上的冗余 expert 数量。", ge=0)
    eplb_update_interval: Int64 = flag(1000, "EPLB 更新间隔。", gt=0)
    expert_parallel_degree: Int32 = flag(0, "Expert parallel degree。", ge=0)


class DistributedConfig(FlagGroup):
    """distributed flags (xLLM)."""

    master_node_addr: str = flag("127.0.0.1:19888", "多机分布式服务的 master 地址,例如 10.18.1.1:9999。")
    worker_memory_master_node_addr: str = flag("127.0.0.1:19889", "rank 0 上收集 worker memory RPC 服务地址的注册地址,例如 10.18.1.1:9999;仅启用虚拟内存且 nnodes > 1 时使用。")
    nnodes: Int32 = flag(1, "多机节点数量。", ge=1)
    node_rank: Int32 = flag(0, "当前节点 rank。", ge=0)
    etcd_addr: str = flag("", "保存实例元信息的 etcd 地址。")
    etcd_namespace: str = flag("", "xLLM etcd key 使用的可选 namespace 前缀,例如 prod-a。")
    enable_service_routing: bool = flag(False, "是否启用 xLLM service routing。")
    xservice_rpc_protocol: choice("baidu_std", "http") = flag("baidu_std", "XServiceClient 与服务层通信使用的协议,支持 baidu_std 和 http。不改变 P/D 引擎间的 RPC 和 KV 传输协议。")
    xservice_address: str = flag("", "HTTP 服务层的直连控制地址(host:port),用于实例注册、心跳和元信息查询。要求 xservice_rpc_protocol=http,与 etcd_addr 互斥。具体请求的结果回传使用请求中携带的服务层地址。")
    heart_beat_interval: float = flag(0.5, "心跳间隔。", gt=0)
    etcd_ttl: Int32 = flag(3, "etcd key 的 TTL。", gt=0)


class PDDisaggConfig(FlagGroup):
    """PD disaggregation flags (xLLM)."""

    enable_disagg_pd: bool = flag(False, "是否启用 Prefill-Decode 分离执行;详见 PD 分离。")
    disagg_pd_port: Int32 = flag(7777, "PD 分离 bRPC server 的监听端口。", ge=1, le=65535)
    instance_role: choice("DEFAULT", "PREFILL", "DECODE", "MIX") = flag("DEFAULT", "当前实例角色,例如 DEFAULT、PREFILL、DECODE、MIX。")
    kv_cache_transfer_mode: choice("PUSH", "PULL") = flag("PUSH", "KV Cache 传输模式,例如 PUSH、PULL。")
    transfer_listen_port: Int32 = flag(26000, "KV Cache Transfer 的监听端口。", ge=1, le=65535)
    kv_push_dst_rotate: bool = flag(False, "在 push_kv_blocks 中按 KV-split rank 轮转遍历目标 worker,用于分散对 decode worker 的流量。")
