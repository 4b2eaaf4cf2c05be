"""Device graphs for decode steps (`--enable_graph`): the bookkeeping every graph-capable backend
shares. A backend subclasses `DeviceGraphRunner` and supplies `GraphOps` for its graph API
(torch.cuda.CUDAGraph, torch.npu.NPUGraph, torch.mlu.MLUGraph).

At start-up the model runner hands over the decode batch sizes to capture (heterollm's
`graph_batch_sizes`: `--max_tokens_for_graph_mode` and `--max_seqs_per_batch` bound them;
`--enable_graph_mode_decode_no_padding` asks for every size, otherwise buckets 1, 2, 4, 8 then every
8) and a maker of decode steps whose block tables are as wide as any step's. Every bucket is
captured then, largest first, the graphs sharing one memory pool; nothing is captured while
serving. Inputs and attention metadata live in static buffers that each replay fills (a batch of n
in bucket b pads rows n..b-1 onto the attention backend's scratch block; a table narrower than the
buffers repeats its last block). A batch with a prefill
chunk, or larger than the largest bucket, runs eagerly; so does a batch that would need padding
when the backend's layout has no scratch block.

Capture, per-replay host-argument updates and replay go through `GraphOps`, so the bookkeeping (buckets, padding, static buffers)
is tested on CPU with ops that simply re-run the captured function (heterollm.testing.graphs).
The attention backend's decode-only path must read only the metadata fields the static buffers
hold (slot_mapping, seq_lens, block_tables, query_start_loc) and run without host synchronization
(model_executor/paged_attention.py does).
"""
from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from heterollm.interfaces import DecodeInputs, GraphRunner, StepForward, StepInputs


class GraphOps(ABC):
    """One device's graph API."""

    @abstractmethod
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Any, torch.Tensor]:
        """Warm `fn` up, capture it; returns (graph, the output tensor each replay rewrites).
        Successive captures share one memory pool."""

    @abstractmethod
    def replay(self, graph: Any) -> None:
        """Run the captured graph again over the current contents of its input buffers."""

    def update(self, graph: Any, inputs: StepInputs) -> None:
        """Called before each replay, once the static buffers hold `inputs` (the live, unpadded
        step): push the arguments a captured kernel takes from the host into the graph (torch_npu's
        graph task update of paged attention's sequence lengths under ACL graphs). Default: none
        (a CUDA graph reads every argument from device buffers)."""


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
    """(largest bucket, widest table) block ids."""
    pad_block: int
    """The scratch block padded rows point at (unused where the layout has none)."""
    can_pad_rows: bool


class DeviceGraphRunner(GraphRunner):
    """Not registered itself: a backend registers a subclass that supplies `make_ops`."""

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

    def capture(self, forward: StepForward, batch_sizes: Sequence[int], make_inputs: DecodeInputs) -> None:
        self.sizes, self.static = [], None
        self.graphs.clear()
        sizes = sorted(set(batch_sizes))
        if not sizes:
            return
        try:
            for bucket in reversed(sizes):  # largest first: it sizes the buffers and the pool
                example = make_inputs(bucket)
                if self.static is None:
                    self.static = self._allocate(example, bucket)
                self._fill(example, bucket)
                static_inputs = self._static_inputs(example, bucket)
                self.graphs[bucket] = self.ops.capture(lambda inputs=static_inputs: forward(inputs))
        except BaseException:
            self.static = None
            self.graphs.clear()
            raise
        self.sizes = sizes

    def can_replay(self, num_tokens: int, is_decode_only: bool) -> bool:
        if not (is_decode_only and self.sizes and num_tokens <= self.sizes[-1]):
            return False
        return self.static.can_pad_rows or num_tokens in self.sizes  # no scratch block: no padded rows

    def run(self, forward: StepForward, inputs: StepInputs) -> torch.Tensor:
        n = inputs.num_tokens
        bucket = self._bucket(n, inputs.ctx.metadata.decode_only, inputs.ctx.metadata.block_tables.shape[1])
        if bucket is None:
            return forward(inputs)
        self._fill(inputs, bucket)
        graph, out = self.graphs[bucket]
        self.ops.update(graph, inputs)
        self.ops.replay(graph)
        self.num_replays += 1
        return out[:n]

    def _bucket(self, n: int, decode_only: bool, table_width: int) -> int | None:
        """The captured bucket a step replays, or None to run it eagerly."""
        if not self.can_replay(n, decode_only) or table_width > self.width:
            return None
        return next(s for s in self.sizes if s >= n)

    @staticmethod
    def _allocate(example: StepInputs, size: int) -> _Static:
        ctx = example.ctx
        scratch = ctx.backend.scratch_block(ctx.kv_caches[0])
        width = ctx.metadata.block_tables.shape[1]
        long = dict(dtype=torch.long, device=example.input_ids.device)
        return _Static(torch.zeros(size, **long), torch.zeros(size, **long), torch.zeros(size, **long),
                       torch.ones(size, **long), torch.zeros(size, width, **long),
                       pad_block=0 if scratch is None else scratch, can_pad_rows=scratch is not None)

    def _fill(self, inputs: StepInputs, bucket: int) -> None:
        """Copy a step of n <= bucket decodes into the static buffers; rows n..bucket-1 become
        one-token sequences writing and reading only the scratch block."""
        s, meta, n = self.static, inputs.ctx.metadata, inputs.num_tokens
        s.input_ids[:n].copy_(inputs.input_ids)
        s.positions[:n].copy_(inputs.positions)
        s.slot_mapping[:n].copy_(meta.slot_mapping)
        s.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        s.block_tables[:n, :width].copy_(meta.block_tables)
        # wider than the step's tables: repeat each row's last block (written, so finite, and masked)
        s.block_tables[:n, width:].copy_(meta.block_tables[:, width - 1:].expand(n, self.width - width))
        if bucket > n:
            s.input_ids[n:bucket].zero_()
            s.positions[n:bucket].zero_()
            s.slot_mapping[n:bucket].fill_(s.pad_block * meta.block_size)
            s.seq_lens[n:bucket].fill_(1)
            s.block_tables[n:bucket].fill_(s.pad_block)

    def _static_inputs(self, example: StepInputs, bucket: int) -> StepInputs:
        """The example step with every per-step tensor replaced by its static buffer."""
        s = self.static
        meta = dataclasses.replace(example.ctx.metadata, slot_mapping=s.slot_mapping[:bucket],
                                   seq_lens=s.seq_lens[:bucket], block_tables=s.block_tables[:bucket],
                                   query_start_loc=torch.arange(bucket + 1, device=s.seq_lens.device))
        return StepInputs(s.input_ids[:bucket], s.positions[:bucket], dataclasses.replace(example.ctx, metadata=meta))
