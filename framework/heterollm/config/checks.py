"""Launch checks that need flags of more than one group (the resolver runs them beside check_support)."""
from __future__ import annotations

from heterollm.config.cache import kv_events_port_problems, parse_kv_events_config
from heterollm.config.base import INT32_MAX
from heterollm.config.schema import HeterollmConfig, current_schema
from heterollm.spec_decode.config import spec_problems


def check_flag_combinations(config: HeterollmConfig) -> list[str]:
    """One line per combination of flag values that cannot launch together."""
    problems: list[str] = []
    sched = config.scheduler
    if sched.priority_strategy == "fcfs":
        for name in ("aggressive_coeff", "starve_threshold"):
            if getattr(sched, name) != 1.0:
                problems.append(f"--{name}={getattr(sched, name)}: tunes starvation prevention, which only "
                                f"--priority_strategy=priority or deadline needs (fcfs cannot starve a request)")
    dist, world = config.distributed, world_size(config)
    if world % dist.nnodes:
        what = "--tp_size" if world == config.parallel.tp_size else "the ranks (--dp_size x --tp_size)"
        problems.append(f"--nnodes={dist.nnodes}: must divide {what}={world} (each node runs 1 / nnodes of the ranks)")
    if dist.node_rank >= dist.nnodes:
        problems.append(f"--node_rank={dist.node_rank}: must be below --nnodes={dist.nnodes}")
    if engine_replicas(config) > 1 and dist.nnodes > 1:
        problems.append(f"--dp_size={config.parallel.dp_size}: replicas run in one process on one node; with "
                        f"--nnodes={dist.nnodes} they would all meet at one --master_node_addr")
    prof = config.profile
    if not prof.enable_latency_aware_schedule:
        for name, default in (("profile_max_prompt_length", 2048), ("enable_profile_kv_blocks", True)):
            if getattr(prof, name) != default:
                problems.append(f"--{name}={getattr(prof, name)}: only --enable_latency_aware_schedule's start-up "
                                f"profile uses it (set that too)")
        if prof.max_global_tpot_ms != INT32_MAX and not prof.enable_profile_token_budget:
            problems.append(f"--max_global_tpot_ms={prof.max_global_tpot_ms}: only --enable_latency_aware_schedule "
                            f"and --enable_profile_token_budget use it (set one of them too)")
    for flag in ("enable_latency_aware_schedule", "enable_profile_token_budget"):
        if getattr(prof, flag) and prof.max_global_tpot_ms >= INT32_MAX:
            problems.append(f"--{flag}: needs --max_global_tpot_ms, the TPOT target "
                            + ("it keeps running decodes within" if flag.startswith("enable_latency")
                               else "a step's tokens are budgeted to meet"))
    problems += expert_parallel_problems(config)
    problems += discovery_problems(config)
    problems += spec_problems(config)
    from heterollm.kv_cache.pd import pd_problems

    problems += pd_problems(config)
    tier = config.kv_cache_store.host_blocks_factor > 0 or config.fastdeploy.swap_space
    if config.kv_cache_store.enable_control_h2d_block_num:
        if not tier:
            problems.append("--enable_control_h2d_block_num=true: caps the host KV tier's copies back per step; "
                            "there is no host tier without --host_blocks_factor or --swap_space")
        if not config.profile.enable_latency_aware_schedule:
            problems.append("--enable_control_h2d_block_num=true: the cap comes from the step-time model of "
                            "--enable_latency_aware_schedule (as in xLLM): turn it on too")
    batches = config.kv_cache_store.layers_wise_copy_batchs
    if batches != type(config.kv_cache_store)().layers_wise_copy_batchs and not tier:
        problems.append(f"--layers_wise_copy_batchs={batches}: paces the host KV tier's copies back; there is no "
                        "host tier without --host_blocks_factor or --swap_space")
    if config.kv_cache.kv_events_config:
        events = parse_kv_events_config(config.kv_cache.kv_events_config)
        problems += kv_events_port_problems(events, engine_replicas(config))
    return problems


def expert_parallel_size(config: HeterollmConfig) -> int:
    """The EP size the launch runs: --ep_size (xLLM), else --expert_parallel_degree, else every
    tensor-parallel rank under FastDeploy's --enable_expert_parallel, else 1."""
    tp = config.parallel.tp_size
    if config.parallel.ep_size > 1:
        return config.parallel.ep_size
    if config.eplb.expert_parallel_degree > 0:
        return config.eplb.expert_parallel_degree
    return tp if config.fastdeploy.enable_expert_parallel else 1


def attention_dp_size(config: HeterollmConfig) -> int:
    """Attention data parallelism inside one engine (xLLM's `--dp_size` for MoE models): with
    `--dp_size` D > 1 and an expert-parallel size of D x tp_size, the engine runs D x tp_size ranks;
    each DP rank holds its own requests' KV cache and runs attention (and every dense layer) for
    them alone, and the experts are sharded over all ranks. 1 otherwise: `--dp_size` then means
    engine replicas (behind `heterollm serve`)."""
    dp, tp = config.parallel.dp_size, config.parallel.tp_size
    return dp if dp > 1 and expert_parallel_size(config) == dp * tp else 1


def world_size(config: HeterollmConfig) -> int:
    """The ranks of one engine: tp_size, times the attention DP size."""
    return config.parallel.tp_size * attention_dp_size(config)


def engine_replicas(config: HeterollmConfig) -> int:
    """The engines `heterollm serve` starts: --dp_size, unless it is attention data parallelism."""
    return 1 if attention_dp_size(config) > 1 else config.parallel.dp_size


def expert_parallel_problems(config: HeterollmConfig) -> list[str]:
    ep, degree, tp = config.parallel.ep_size, config.eplb.expert_parallel_degree, config.parallel.tp_size
    eplb = config.eplb
    problems = []
    if eplb.enable_eplb and expert_parallel_size(config) == 1:
        problems.append("--enable_eplb: balances experts across expert-parallel ranks; set --ep_size (or "
                        "--enable_expert_parallel) with --tp_size > 1 too")
    if not eplb.enable_eplb:
        specs = current_schema().specs
        for name in ("redundant_experts_num", "eplb_update_interval"):
            if getattr(eplb, name) != specs[name].default:
                problems.append(f"--{name}={getattr(eplb, name)}: only --enable_eplb uses it (set that too)")
    if ep > 1 and degree > 0 and degree != ep:
        return problems + [f"--expert_parallel_degree={degree}: disagrees with --ep_size={ep} (set one of them)"]
    size, dp = expert_parallel_size(config), attention_dp_size(config)
    flag = f"--ep_size={ep}" if ep > 1 else f"--expert_parallel_degree={degree}"
    sp = config.speculative
    if dp > 1 and sp.num_speculative_tokens > 0 and sp.speculative_algorithm == "draft_model":
        problems.append(f"--dp_size={dp} with --speculative_algorithm=draft_model: the draft model's forward is not "
                        f"split over the attention data-parallel ranks; use Suffix or ngram speculation")
    if config.execution.enable_attn_dp_weight_sharding:
        if dp == 1:
            problems.append("--enable_attn_dp_weight_sharding: shards the attention weights over the attention "
                            "data-parallel ranks; set --dp_size with --ep_size = --dp_size (a MoE model) too")
        elif config.fastdeploy.dynamic_load_weight:
            problems.append("--enable_attn_dp_weight_sharding with --dynamic_load_weight: reloading weights into "
                            "sharded attention weights is not built")
    if dp > 1 and tp > 1:
        problems.append(f"--dp_size={dp} with {flag}: attention data parallelism runs each DP rank's attention "
                        f"whole (--tp_size 1, --ep_size = --dp_size); tensor parallelism inside a DP rank "
                        f"(--tp_size={tp}) is not built")
    elif dp == 1 and size not in (1, tp):
        dp_hint = (f", or --dp_size x --tp_size for attention data parallelism (--dp_size={config.parallel.dp_size} "
                   f"gives {config.parallel.dp_size * tp})" if config.parallel.dp_size > 1 else
                   "; or --dp_size with --ep_size = --dp_size for attention data parallelism")
        problems.append(f"{flag}: experts are sharded over the tensor-parallel ranks, so it must equal "
                        f"--tp_size={tp} (or stay 1){dp_hint}; an EP group smaller than TP (experts split inside "
                        f"it too) is not built")
    return problems


def _is_host_port(address: str) -> bool:
    host, _, port = address.rpartition("://")[2].rstrip("/").rpartition(":")
    return bool(host) and port.isdigit() and 0 < int(port) < 65536


def discovery_problems(config: HeterollmConfig) -> list[str]:
    """Service discovery: one service layer (etcd, or an xservice over HTTP), named well."""
    from heterollm.config.support import show_value

    dist, problems = config.distributed, []
    if dist.etcd_addr and dist.xservice_address:
        problems.append("--etcd_addr and --xservice_address: give one (an instance registers in etcd, or over HTTP "
                        "with the xservice at --xservice_address, not both)")
    for name in ("etcd_addr", "xservice_address"):
        value = getattr(dist, name)
        if value and not _is_host_port(value):
            problems.append(f"--{name}={value}: expected host:port")
    if dist.xservice_address and dist.xservice_rpc_protocol == "baidu_std":
        problems.append("--xservice_address with --xservice_rpc_protocol=baidu_std: brpc's baidu_std protocol is "
                        "not built (heterollm has no brpc); use --xservice_rpc_protocol=http")
    if dist.xservice_rpc_protocol == "http" and not dist.xservice_address:
        problems.append("--xservice_rpc_protocol=http: it is the protocol of --xservice_address, which is unset "
                        "(with --etcd_addr an instance registers in etcd and talks to no xservice)")
    if not (dist.etcd_addr or dist.xservice_address):
        specs = current_schema().specs
        for name in ("enable_service_routing", "etcd_namespace", "heart_beat_interval", "etcd_ttl"):
            if getattr(dist, name) != specs[name].default:
                problems.append(f"--{name}={show_value(getattr(dist, name))}: service discovery is off; it needs --etcd_addr "
                                f"or --xservice_address (the instance registers whenever one is given)")
    if dist.etcd_addr and dist.etcd_ttl <= dist.heart_beat_interval:
        problems.append(f"--etcd_ttl={dist.etcd_ttl}: must exceed --heart_beat_interval={dist.heart_beat_interval} "
                        f"(the lease would expire between two renewals)")
    return problems


def check_single_replica(config: HeterollmConfig, where: str) -> None:
    """--dp_size replicas live behind `heterollm serve`; other entry points run one engine, in their
    own process (so the flags of the engine-core process's link mean nothing there either)."""
    from heterollm.config.errors import ConfigError

    if engine_replicas(config) > 1:
        raise ConfigError(f"--dp_size={config.parallel.dp_size}: engine replicas are served behind `heterollm serve`; "
                          f"{where} runs one engine")
    values, specs = config.flat(), current_schema().specs
    for name in ("engine_worker_queue_port", "rpc_channel_timeout_ms"):
        if values[name] != specs[name].default:
            raise ConfigError(f"--{name}={values[name]}: it sets up the link to `heterollm serve`'s engine-core "
                              f"process; {where} runs the engine in its own process")
    for name in ("etcd_addr", "xservice_address"):
        if values[name]:
            raise ConfigError(f"--{name}={values[name]}: it registers `heterollm serve`'s HTTP server for routing; "
                              f"{where} serves no HTTP")
