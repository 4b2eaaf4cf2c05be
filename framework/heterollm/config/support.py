"""The core's table of flags that cannot leave their default yet, whatever the platform.

A flag listed here is refused at a non-default value (a feature a later issue builds, DiT or
multimodal models, a FastDeploy-internal process). What a platform or family cannot serve is its
own backend's word (`Backend.unsupported`, `Component.validate`), checked by the resolver; flags a
backend owns are refused when that backend is not selected. Launch collects every refusal into one
error, so a flag is never silently ignored. Flags not listed work everywhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from heterollm.config.execution import DiTConfig
from heterollm.config.schema import HeterollmConfig, current_schema


@dataclass(frozen=True)
class Rule:
    """Why a flag cannot leave its default here."""

    reason: str
    ok_values: tuple[Any, ...] = ()
    """Non-default values that are accepted anyway (e.g. turning an unbuilt feature off)."""


def _rules(names: str, reason: str, ok: tuple[Any, ...] = ()) -> dict[str, Rule]:
    return {n: Rule(reason, ok) for n in names.split()}


DIT = "DiT (diffusion) models only; heterollm serves text LLMs"
AUDIO = ("audio input: no family heterollm serves takes audio (Qwen2-VL and Qwen2.5-VL take images); "
         "an audio or video part of a request is refused with HTTP 400")
NO_EQUIVALENT = "FastDeploy-internal; heterollm has no such component"
IN_PROCESS = ("xLLM's bRPC handler thread pools have no equivalent: heterollm's API server handles requests on one "
              "asyncio loop and each engine-core process's outputs on one receiver thread")

RULES: dict[str, Rule] = {
    **_rules("sp_size cfg_size vae_size max_requests_per_batch " + " ".join(
        n for n in DiTConfig.model_fields if n.startswith("dit_")), DIT),
    **_rules("use_audio_in_video audio_max_upload_file_mb audio_max_decode_duration_s", AUDIO),
    **_rules("cache_queue_port", NO_EQUIVALENT),
    **_rules("num_threads num_request_handling_threads num_response_handling_threads", IN_PROCESS),
    **_rules("disable_ttft_profiling", "it skips the TTFT / TPOT start-up profile a disaggregated-PD instance "
             "reports to xLLM's service router; heterollm's instances report their load (running, waiting, KV usage) "
             "and `heterollm route` balances by it: there is no such profile to skip"),
}

def _planned(names: str, reason: str, ok: tuple[Any, ...] = ()) -> None:
    """Features that a later issue builds: each entry leaves when its feature lands."""
    RULES.update(_rules(names, f"not built yet ({reason})", ok))


_planned("enable_return_mm_full_embeddings enable_return_embedding_modality_tags", "multimodal embeddings (the "
         "vision encoder's and the sequence's embeddings returned); vision-language generation works")
_planned("task", "--task=mm_embed, multimodal embeddings; generate and embed work", ok=("embed",))
_planned("backend", "the dit backend (diffusion models); --backend=llm and --backend=vlm are accepted",
         ok=("llm", "vlm"))
_planned("cp_size kv_split_size "
         "worker_memory_master_node_addr enable_dp_fair_token_budget", "the parallelism issue")
_planned("graph_optimization_config "
         "enable_shm use_contiguous_input_buffer input_shm_size output_shm_size",
         "the accelerator backends issue")
_planned("indexer_cache_dtype max_linear_state_cache_slots phy_page_granularity_size enable_dsa_multi_stream",
         "models with indexer / linear-attention caches")


def check_support(config: HeterollmConfig) -> list[str]:
    """One line per flag of the core's table that leaves its default."""
    values = config.flat()
    specs = current_schema().specs
    problems = []
    for name, rule in RULES.items():
        value = values[name]
        if value == specs[name].default or value in rule.ok_values:
            continue
        problems.append(f"--{name}={show_value(value)}: {rule.reason}")
    return problems


def show_value(value: Any) -> str:
    """A flag value as the command line spells it."""
    return str(value).lower() if isinstance(value, bool) else str(value)
