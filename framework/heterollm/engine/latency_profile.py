"""Start-up runs before any request is admitted: the step-time profile that seeds the scheduler's
model (--enable_latency_aware_schedule, with its targets), and the warm-up pass (--use_warmup)."""
from __future__ import annotations

import logging
import time
import uuid
from typing import TYPE_CHECKING

import torch

from heterollm.config import HeterollmConfig
from heterollm.config.base import INT32_MAX
from heterollm.pooling import PoolingParams
from heterollm.sampling import SamplingParams
from heterollm.scheduler.latency import LatencyTargets, StepTimeModel

if TYPE_CHECKING:
    from heterollm.engine.llm_engine import LLMEngine

logger = logging.getLogger("heterollm.engine")


def latency_targets(config: HeterollmConfig) -> LatencyTargets | None:
    prof = config.profile
    if not prof.enable_latency_aware_schedule:
        return None
    ttft = prof.max_global_ttft_ms if prof.max_global_ttft_ms < INT32_MAX else None
    return LatencyTargets(StepTimeModel(), prof.max_global_tpot_ms, ttft)


def profile_step_time(engine: LLMEngine) -> None:
    """Prefills of growing length up to --profile_max_prompt_length, then decode batches of 1, 4
    and 16, with random tokens, run through the engine; the model learns from every step."""
    t0 = time.perf_counter()
    cfg = engine.config.scheduler
    longest = min(engine.config.profile.profile_max_prompt_length, cfg.max_tokens_per_batch,
                  engine.max_model_len - 2, engine.scheduler.chunk_size)
    gen = torch.Generator().manual_seed(0)
    sizes = sorted({max(1, longest >> k) for k in range(0, 10, 2)})
    batches = [[(n, 1)] for n in sizes] + [[(32, 4)] * b for b in (1, 4, 16) if b <= cfg.max_seqs_per_batch]
    run_startup_batches(engine, batches, gen)
    model = engine.scheduler.latency.model
    logger.info("latency-aware scheduling: profiled %d steps in %.1f s; %s", len(model.samples),
                time.perf_counter() - t0, model.describe())


def warm_up(engine: LLMEngine) -> list[tuple[int, int]]:
    """--use_warmup 1: before serving, run the largest steps the limits allow, with random tokens:
    one prompt as long as --max_model_len allows (less two tokens to generate; chunked as any
    prompt), then a decode batch of --max_seqs_per_batch requests (as many as the KV cache holds
    with a block each). Kernels, allocator and caches are warm when the first request arrives; the
    prefix cache is emptied afterwards. Returns the (prompt tokens, tokens to generate) it ran."""
    t0 = time.perf_counter()
    cfg, kv = engine.config.scheduler, engine.kv
    capacity = engine.num_blocks * kv.block_size
    longest = max(1, min(engine.max_model_len, capacity) - 2)
    if not cfg.enable_chunked_prefill:
        longest = min(longest, cfg.max_tokens_per_batch)
    width = max(1, min(cfg.max_seqs_per_batch, engine.num_blocks))
    short = max(1, min(4, kv.block_size - 2))
    batches = [[(longest, 2)], [(short, 2)] * width]
    run_startup_batches(engine, batches, torch.Generator().manual_seed(0))
    if kv.enable_prefix_cache:
        kv.reset_prefix_cache()
    logger.info("warm-up (--use_warmup): a %d-token prompt, then %d requests decoding together, in %.1f s",
                longest, width, time.perf_counter() - t0)
    return [shape for batch in batches for shape in batch]


def run_startup_batches(engine: LLMEngine, batches: list[list[tuple[int, int]]], gen: torch.Generator) -> None:
    """Each batch of (prompt tokens, tokens to generate) runs to the end through the engine, random
    tokens; then the KV cache's counters and events forget them (they are not traffic)."""
    # a launch that cannot generate (--task embed, a classifier) runs its prompts as pooling requests
    pooling = None if engine.pooling.generation_refusal() is None else PoolingParams(
        task="embed" if engine.pooling.task == "embed" else "score")
    for batch in batches:
        ids = [engine.add_request(torch.randint(3, engine.vocab_size, (n,), generator=gen).tolist(),
                                  SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                                  request_id=f"__startup-{uuid.uuid4().hex}", pooling=pooling) for n, m in batch]
        while any(engine.is_unfinished(i) for i in ids):
            engine.step()
    engine.kv.reset_counters()
    if engine.kv_events is not None:
        engine.kv.take_events()  # these blocks are not traffic a router should see
