"""Device graphs for decode steps (`--enable_graph`): the bookkeeping every graph-capable backend
shares. A backend subclasses `DeviceGraphRunner`, names its platforms and supplies `GraphOps` for
its graph API (torch.cuda.CUDAGraph, torch.npu.NPUGraph, torch.mlu.MLUGraph).

The model runner hands over the decode batch sizes to capture (heterollm's `graph_batch_sizes`:
`--max_tokens_for_graph_mode` and `--max_seqs_per_batch` bound them; `--enable_graph_mode_decode_no_padding`
asks for every size, otherwise buckets 1, 2, 4, 8 then every 8). A bucket is captured the first time a decode batch
needs it, on live shapes: its inputs and attention metadata live in static buffers that each
replay fills (a batch of n in bucket b pads rows n..b-1 onto the cache's scratch block); the
graphs share one memory pool. A batch with a prefill chunk, larger than the largest bucket, or
with block tables wider than the captured width (recaptured wider next time) runs eagerly.

Capture and replay go through `GraphOps`, so the bookkeeping (buckets, padding, static buffers)
is tested on CPU with ops that simply re-run the captured function. The attention backend must
keep a scratch block last in each cache and run decode-only steps without host synchronization
(model_executor/paged_attention.py does both).
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from heterollm.interfaces import GraphRunner


class GraphOps(ABC):
    """One device's graph API."""

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Warm `fn` up, capture it; returns (graph, the output tensor each replay rewrites)."""

    @abstractmethod
    def replay(self, graph: Any) -> None:
        """Run the captured graph again over the current contents of its input buffers."""


class StreamGraphOps(GraphOps):
    """The CUDA-style graph API (torch.cuda; torch_npu and torch_mlu mirror it as `torch.npu` and
    `torch.mlu`): warm-up on a side stream, capture into one memory pool shared by all graphs."""

    def __init__(self, module: Any, graph_class: str) -> None:
        self.device_module, self.graph_class = module, graph_class
        self.pool = None

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        mod = self.device_module
        stream = mod.Stream()
        stream.wait_stream(mod.current_stream())
        with mod.stream(stream):
            for _ in range(2):
                fn()
        mod.current_stream().wait_stream(stream)
        graph = getattr(mod, self.graph_class)()
        with mod.graph(graph, pool=self.pool):
            out = fn()
        self.pool = graph.pool()
        return graph, out

    def replay(self, graph: Any) -> None:
        graph.replay()


@dataclasses.dataclass
class _Static:
    """Buffers sized for the largest bucket; bucket b uses their first b rows."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor


class DeviceGraphRunner(GraphRunner):
    """Not registered itself: a backend registers a subclass that sets `platforms` and `make_ops`."""

    platforms = ()

    @classmethod
    def validate(cls, config) -> list[str]:
        return []

    def make_ops(self) -> GraphOps:
        raise NotImplementedError(f"{type(self).__name__} must supply its device's GraphOps")

    def __init__(self, ops: GraphOps | None = None) -> None:
        self.ops = ops or self.make_ops()
        self.sizes: list[int] = []
        self.graphs: dict[int, tuple[Any, torch.Tensor]] = {}
        self.static: _Static | None = None
        self.num_replays = 0

    @property
    def width(self) -> int:
        """Block-table columns the static buffers (and so the captured graphs) hold; 0 before any."""
        return 0 if self.static is None else self.static.block_tables.shape[1]

    def capture(self, forward: Callable[..., Any], batch_sizes: Sequence[int]) -> None:
        self.sizes = sorted(set(batch_sizes))
        self.graphs.clear()
        self.static = None

    def can_replay(self, num_tokens: int, is_decode_only: bool) -> bool:
        return is_decode_only and bool(self.sizes) and num_tokens <= self.sizes[-1]

    def run(self, forward: Callable[..., Any], **inputs: Any) -> Any:
        ctx = inputs.get("ctx")  # a forward without attention (the conformance kit's) runs eagerly
        meta = getattr(ctx, "metadata", None)
        n = inputs["input_ids"].shape[0]
        if not self.can_replay(n, getattr(meta, "decode_only", False)):
            return forward(**inputs)
        if meta.block_tables.shape[1] > self.width:  # wider tables than captured: recapture wider
            self._allocate(inputs["input_ids"].device, max(meta.block_tables.shape[1], 2 * self.width, 16))
        bucket = next(s for s in self.sizes if s >= n)
        self._fill(inputs["input_ids"], inputs["positions"], meta, ctx.kv_caches[0], n, bucket)
        if bucket not in self.graphs:
            static_inputs = self._static_inputs(ctx, bucket)
            self.graphs[bucket] = self.ops.capture(lambda: forward(**static_inputs))
        graph, out = self.graphs[bucket]
        self.ops.replay(graph)
        self.num_replays += 1
        return out[:n]

    def _allocate(self, device: torch.device, width: int) -> None:
        size = self.sizes[-1]
        long = dict(dtype=torch.long, device=device)
        self.static = _Static(torch.zeros(size, **long), torch.zeros(size, **long), torch.zeros(size, **long),
                              torch.ones(size, **long), torch.zeros(size, width, **long))
        self.graphs.clear()  # captured graphs point at the old buffers

    def _fill(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: Any, kv_cache: torch.Tensor, n: int,
              bucket: int) -> None:
        s = self.static
        scratch = kv_cache.shape[1] - 1
        s.input_ids[:n].copy_(input_ids)
        s.positions[:n].copy_(positions)
        s.slot_mapping[:n].copy_(meta.slot_mapping)
        s.seq_lens[:n].copy_(meta.seq_lens)
        s.block_tables[:n].fill_(scratch)
        s.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if bucket > n:  # padding rows: one token each, written to and read from the scratch block
            s.input_ids[n:bucket].zero_()
            s.positions[n:bucket].zero_()
            s.slot_mapping[n:bucket].fill_(scratch * meta.block_size)
            s.seq_lens[n:bucket].fill_(1)
            s.block_tables[n:bucket].fill_(scratch)

    def _static_inputs(self, ctx: Any, bucket: int) -> dict[str, Any]:
        s = self.static
        meta = dataclasses.replace(ctx.metadata, num_tokens=bucket, slot_mapping=s.slot_mapping[:bucket],
                                   seq_lens=s.seq_lens[:bucket], block_tables=s.block_tables[:bucket],
                                   query_start_loc=torch.arange(bucket + 1, device=s.seq_lens.device),
                                   query_lens=[1] * bucket, context_lens=[0] * bucket)
        return {"input_ids": s.input_ids[:bucket], "positions": s.positions[:bucket],
                "ctx": dataclasses.replace(ctx, metadata=meta)}
