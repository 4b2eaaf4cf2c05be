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
    dist, tp = config.distributed, config.parallel.tp_size
    if tp % dist.nnodes:
        problems.append(f"--nnodes={dist.nnodes}: must divide --tp_size={tp} (each node runs tp_size / nnodes ranks)")
    if dist.node_rank >= dist.nnodes:
        problems.append(f"--node_rank={dist.node_rank}: must be below --nnodes={dist.nnodes}")
    if config.parallel.dp_size > 1 and dist.nnodes > 1:
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
    problems += spec_problems(config)
    if config.kv_cache.kv_events_config:
        events = parse_kv_events_config(config.kv_cache.kv_events_config)
        problems += kv_events_port_problems(events, config.parallel.dp_size)
    return problems


def check_single_replica(config: HeterollmConfig, where: str) -> None:
    """--dp_size replicas live behind `heterollm serve`; other entry points run one engine, in their
    own process (so the flags of the engine-core process's link mean nothing there either)."""
    from heterollm.config.errors import ConfigError

    if config.parallel.dp_size > 1:
        raise ConfigError(f"--dp_size={config.parallel.dp_size}: engine replicas are served behind `heterollm serve`; "
                          f"{where} runs one engine")
    values, specs = config.flat(), current_schema().specs
    for name in ("engine_worker_queue_port", "rpc_channel_timeout_ms"):
        if values[name] != specs[name].default:
            raise ConfigError(f"--{name}={values[name]}: it sets up the link to `heterollm serve`'s engine-core "
                              f"process; {where} runs the engine in its own process")
