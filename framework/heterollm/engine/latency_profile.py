"""Start-up runs before any request is admitted: the step-time profile that seeds the scheduler's
model (--enable_latency_aware_schedule, with its targets), and the warm-up pass (--use_warmup)."""
from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from heterollm.config import ConfigError, HeterollmConfig
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
    targets = LatencyTargets(StepTimeModel(), prof.max_global_tpot_ms, ttft)
    targets.h2d_control = config.kv_cache_store.enable_control_h2d_block_num
    return targets


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
    block = engine.kv.block_size
    if engine.config.profile.enable_profile_kv_blocks and engine.kv.enable_prefix_cache:
        # prefills after cached context: a prompt, then the same prompt with as many tokens again,
        # whose first blocks the prefix cache hands back (the attention term over cached keys)
        for n in sizes:
            half = n // 2 // block * block
            if half >= block:
                prompt = torch.randint(3, engine.vocab_size, (half,), generator=gen).tolist()
                run_startup_batches(engine, [[(prompt, 1)]], gen)
                run_startup_batches(engine, [[(prompt + torch.randint(3, engine.vocab_size, (n - half,),
                                                                       generator=gen).tolist(), 1)]], gen)
        engine.kv.reset_prefix_cache()
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


def profile_token_budget(engine: LLMEngine, measure: Callable[[int], float] | None = None) -> int:
    """--enable_profile_token_budget: the most tokens one step may carry and still end within
    --max_global_tpot_ms, found by binary search over single-prompt steps (a prompt of n random
    tokens, prefilled in one step: the median of 3 runs). The search runs up to the smallest of
    --max_tokens_per_batch, the prefill chunk, max_model_len and the KV cache. `measure(n)` -> seconds
    (for tests); by default the engine's own step time."""
    t0 = time.perf_counter()
    cfg, target = engine.config.scheduler, engine.config.profile.max_global_tpot_ms / 1000
    upper = max(1, min(cfg.max_tokens_per_batch, engine.scheduler.chunk_size, engine.max_model_len - 1,
                       engine.num_blocks * engine.kv.block_size - 1))
    gen = torch.Generator().manual_seed(1)

    def step_seconds(n: int) -> float:
        times = []
        for _ in range(3):
            started = time.perf_counter()
            run_startup_batches(engine, [[(n, 1)]], gen)
            times.append(time.perf_counter() - started)
        return sorted(times)[1]

    measure = measure or step_seconds
    lo, hi = 0, upper  # the answer lies in [lo, hi]: lo fits (0 trivially), above hi nothing was tried
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if measure(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    if engine.kv.enable_prefix_cache:
        engine.kv.reset_prefix_cache()
    if lo == 0:
        raise ConfigError(f"--enable_profile_token_budget: even a 1-token step takes longer than "
                          f"--max_global_tpot_ms={engine.config.profile.max_global_tpot_ms} here; raise the target")
    logger.info("token budget (--enable_profile_token_budget): %d tokens per step keep a step within %d ms "
                "(searched up to %d) in %.1f s", lo, engine.config.profile.max_global_tpot_ms, upper,
                time.perf_counter() - t0)
    return lo


def run_startup_batches(engine: LLMEngine, batches: list[list[tuple[int | list[int], int]]],
                        gen: torch.Generator) -> None:
    """Each batch of (prompt, tokens to generate) runs to the end through the engine: a prompt is
    its tokens, or a length (random tokens). Then the KV cache's counters and events forget them
    (they are not traffic)."""
    # a launch that cannot generate (--task embed, a classifier) runs its prompts as pooling requests
    pooling = None if engine.pooling.generation_refusal() is None else PoolingParams(
        task="embed" if engine.pooling.task == "embed" else "score")
    for batch in batches:
        ids = [engine.add_request(n if isinstance(n, list) else torch.randint(3, engine.vocab_size, (n,),
                                                                              generator=gen).tolist(),
                                  SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                                  request_id=f"__startup-{uuid.uuid4().hex}", pooling=pooling) for n, m in batch]
        while any(engine.is_unfinished(i) for i in ids):
            engine.step()
    engine.kv.reset_counters()
    if engine.kv_events is not None:
        engine.kv.take_events()  # these blocks are not traffic a router should see
