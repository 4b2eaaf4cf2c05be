"""Launch checks that need flags of more than one group (the resolver runs them beside check_support)."""
from __future__ import annotations

from heterollm.config.cache import kv_events_port_problems, parse_kv_events_config
from heterollm.config.schema import HeterollmConfig


def check_flag_combinations(config: HeterollmConfig) -> list[str]:
    """One line per combination of flag values that cannot launch together."""
    problems: list[str] = []
    sched = config.scheduler
    if sched.priority_strategy == "fcfs":
        for name in ("aggressive_coeff", "starve_threshold"):
            if getattr(sched, name) != 1.0:
                problems.append(f"--{name}={getattr(sched, name)}: tunes starvation prevention, which only "
                                f"--priority_strategy=priority or deadline needs (fcfs cannot starve a request)")
    if config.kv_cache.kv_events_config:
        events = parse_kv_events_config(config.kv_cache.kv_events_config)
        problems += kv_events_port_problems(events, config.parallel.dp_size)
    return problems
