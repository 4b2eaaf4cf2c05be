"""The CPU's graph runner: eager unless `--enable_graph`. With it, decode-only steps run the model
through `torch.compile` (inductor's C++/OpenMP code): the ~1,500 small torch calls of a step fuse
into a few dozen loops between the GEMMs. Two graphs serve every decode batch up to the largest
size `graph_batch_sizes` asks for: the batch and context dimensions the attention metadata names
(`dynamic_dims`) and the caches' block count are compiled as symbols, not specialized on sizes 0
and 1, except that a batch of one gets its own graph (dynamo specializes a reshape in the attention
on it). Prefill and mixed steps stay eager.

Compiling costs about two minutes on 2 cores the first time (the model runner compiles at start-up,
before the engine takes requests); inductor caches the result on disk (TORCHINDUCTOR_CACHE_DIR), so
a restart only traces the model again (~15 s). The graph is specialized on torch's thread count:
changing it afterwards compiles again (`heterollm serve` sets its threads before the warm-up).
Measured in bench/RESULTS.md (2026-12-04)."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx.experimental._config as fx_config

from heterollm.interfaces import GraphRunner


class CpuGraphRunner(GraphRunner):
    platforms = ("cpu",)

    @classmethod
    def validate(cls, config) -> list[str]:
        if config.execution.enable_graph and config.parallel.tp_size > 1:
            return ["--enable_graph with --tp_size > 1 is not supported on CPU yet (each rank would compile the "
                    "step on its own core, and collectives inside the compiled step are untested)"]
        return []

    def __init__(self) -> None:
        self.compiled: Callable[..., Any] | None = None
        self.max_batch = 0
        self.num_replays = 0

    def capture(self, forward: Callable[..., Any], batch_sizes: Sequence[int]) -> None:
        """`batch_sizes` is empty without `--enable_graph`: then every step runs eagerly."""
        self.max_batch = max(batch_sizes, default=0)
        self.compiled = torch.compile(forward, dynamic=False) if batch_sizes else None

    def can_replay(self, num_tokens: int, is_decode_only: bool) -> bool:
        return self.compiled is not None and is_decode_only and num_tokens <= self.max_batch

    def run(self, forward: Callable[..., Any], **inputs: Any) -> Any:
        meta = getattr(inputs.get("ctx"), "metadata", None)
        decode_only = getattr(meta, "decode_only", False) and hasattr(meta, "dynamic_dims")
        if not self.can_replay(inputs["input_ids"].shape[0], decode_only):
            return forward(**inputs)
        # the caches' block count too: it follows free memory, and a graph specialized on it would miss
        # inductor's on-disk cache on the next start
        caches = [(cache, 2) for cache in inputs["ctx"].kv_caches]
        for tensor, dim in [(inputs["input_ids"], 0), (inputs["positions"], 0), *meta.dynamic_dims(), *caches]:
            torch._dynamo.maybe_mark_dynamic(tensor, dim)
        # no duck sizing or 0/1 specialization: one context block or no fresh block takes the same graph
        with fx_config.patch(backed_size_oblivious=True, use_duck_shape=False):
            out = self.compiled(**inputs)
        self.num_replays += 1
        return out
