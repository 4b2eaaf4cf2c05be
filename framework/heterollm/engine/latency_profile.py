"""--enable_latency_aware_schedule at launch: the scheduler's targets, and the start-up profile that
seeds its step-time model before any request is admitted."""
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
    # a launch that cannot generate (--task embed, a classifier) profiles its prompts as pooling requests
    pooling = None if engine.pooling.generation_refusal() is None else PoolingParams(
        task="embed" if engine.pooling.task == "embed" else "score")
    for batch in batches:
        ids = [engine.add_request(torch.randint(3, engine.vocab_size, (n,), generator=gen).tolist(),
                                  SamplingParams(max_tokens=m, temperature=0, ignore_eos=True),
                                  request_id=f"__profile-{uuid.uuid4().hex}", pooling=pooling) for n, m in batch]
        while any(engine.is_unfinished(i) for i in ids):
            engine.step()
    engine.kv.reset_counters()
    if engine.kv_events is not None:
        engine.kv.take_events()  # the profile's blocks are not traffic a router should see
    model = engine.scheduler.latency.model
    logger.info("latency-aware scheduling: profiled %d steps in %.1f s; %s", len(model.samples),
                time.perf_counter() - t0, model.describe())
