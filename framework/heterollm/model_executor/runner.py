"""The device-agnostic model runner: builds the model, owns the KV cache tensors, turns a
SchedulerOutput into model inputs, runs the forward through the selected GraphRunner and
AttentionBackend, and samples. Backends' executors drive one of these per worker."""
from __future__ import annotations

import logging
import socket
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from heterollm.config import ConfigError, HeterollmConfig
from heterollm.config.checks import attention_dp_size, expert_parallel_size
from heterollm.interfaces import (AttentionInputs, Communicator, ForwardContext, RunnerOutput, ScheduledRequest,
                                  SchedulerOutput, StepInputs, TokenLogprobs)
from heterollm.interfaces.executor import RankMemory
from heterollm.interfaces.kv_connector import KVConnector
from heterollm.model_executor import ops
from heterollm.model_executor.linear_method import (model_bytes, prepare_linears, repack_after_reload,
                                                     select_linear_method, unpack_for_reload)
from heterollm.model_executor.checkpoint_slice import ReadStats
from heterollm.model_executor.layers import CacheLayout, cache_layout
from heterollm.model_executor.kv_moves import KVMoves
from heterollm.model_executor.layerwise import LayerwiseLoad, PushingCaches, WaitingCaches, layer_groups
from heterollm.model_executor.mm_encoder import MultiModalRunner
from heterollm.model_executor.loader import ModelSource, iter_weights
from heterollm.model_executor.moe import FusedMoE, prepare_experts
from heterollm.model_executor.parallel import ParallelContext
from heterollm.model_executor.quant_linear import attach_quantized, checkpoint_methods, prepare_quantized
from heterollm.model_executor.registry import get_model_class
from heterollm.model_executor.weight_sharding import shard_attention_weights
from heterollm.model_executor.weight_update import WeightUpdate, WeightUpdateError
from heterollm.pooling.pooler import Pooler
from heterollm.sampling.sampler import Sampler, SamplingRow, gather_logprobs, wants_logprobs
from heterollm.spec_decode import resolve_spec
from heterollm.spec_decode.draft import DraftModel, rank_seed
from heterollm.spec_decode.rejection import verify, verify_tree

if TYPE_CHECKING:
    from heterollm.interfaces import Platform
    from heterollm.plugins.resolver import Selection

logger = logging.getLogger("heterollm.runner")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(requested: str, hf_config: Any, platform: Platform, is_gguf: bool) -> torch.dtype:
    """--dtype auto: the checkpoint's dtype (bf16 for a dequantized GGUF), replaced by bf16 or
    fp32 where the platform lacks native support for it."""
    if requested != "auto":
        return DTYPES[requested]
    declared = getattr(hf_config, "dtype", None)
    name = str(declared).removeprefix("torch.") if declared is not None else "float32"
    if is_gguf or name not in DTYPES:
        name = "bfloat16"
    if name == "float16" and not platform.supports_dtype("float16"):
        name = "bfloat16"
    if name == "bfloat16" and not platform.supports_dtype("bfloat16"):
        name = "float32"
    return DTYPES[name]


def model_max_len(config: HeterollmConfig, hf_config: Any) -> int:
    """--max_model_len, capped at the model's max_position_embeddings."""
    max_len = config.fastdeploy.max_model_len
    model_max = getattr(hf_config, "max_position_embeddings", None)
    if model_max and max_len > model_max:
        logger.info("max_model_len %d > the model's max_position_embeddings %d; using %d", max_len, model_max,
                    model_max)
        max_len = model_max
    return max_len


def graph_batch_sizes(config: HeterollmConfig) -> list[int]:
    """Decode batch sizes a graph runner captures (`--enable_graph`): up to `--max_tokens_for_graph_mode`
    (0: no limit) and `--max_seqs_per_batch`; every size with `--enable_graph_mode_decode_no_padding`,
    else 1, 2, 4, then multiples of 8 (a batch replays the smallest bucket that holds it, padded)."""
    ex = config.execution
    if not ex.enable_graph:
        return []
    limit = config.scheduler.max_seqs_per_batch
    if ex.max_tokens_for_graph_mode > 0:
        limit = min(limit, ex.max_tokens_for_graph_mode)
    if ex.enable_graph_mode_decode_no_padding:
        return list(range(1, limit + 1))
    return sorted({s for s in (1, 2, 4) if s < limit} | set(range(8, limit + 1, 8)) | {limit})


def device_key(device_type: str) -> str:
    """The memory a rank draws on: the host's name, then the device type plus the current device's
    index where the platform has indices ("node1/npu:1"); a platform without them (the CPU: the host's
    memory, shared by every rank on it) gives the type alone ("node1/cpu")."""
    index = torch.get_device_module(device_type).current_device()
    return f"{socket.gethostname()}/{device_type}" + (f":{index}" if isinstance(index, int) else "")


@dataclass
class LaunchContext:
    """What an executor is constructed with."""

    config: HeterollmConfig
    selection: Selection
    """The platform and the component table the launcher resolved."""
    source: ModelSource
    max_model_len: int
    rank: int = 0
    """Tensor-parallel rank of the worker this context builds (distributed/worker.py sets it)."""
    world_size: int = 1
    communicator: Communicator | None = None
    """The rank's communicator (None for a single rank: its collectives are no-ops)."""


def _load_checked(model: Any, tensors: list, arch: str) -> tuple[set[str], set[str]]:
    """Load `tensors` into `model`; returns (parameters written at all, parameters written whole).
    A name the model lacks or a shape that does not fit is a WeightUpdateError."""
    touched: set[str] = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        loader = getattr(param, "weight_loader", None)
        if loader is not None:
            param.weight_loader = _Recording(loader, touched, name)
    try:
        complete = model.load_weights(iter(tensors))
    except KeyError as exc:
        raise WeightUpdateError("path", f"the new weights hold tensor {exc.args[0]!r}, which the {arch} "
                                        "architecture does not have") from None
    except ValueError as exc:
        raise WeightUpdateError("path", f"the new weights do not fit the model: {exc}") from None
    finally:
        for _, param in model.named_parameters(remove_duplicate=False):
            if isinstance(getattr(param, "weight_loader", None), _Recording):
                param.weight_loader = param.weight_loader.inner
    return touched, complete


@dataclass
class _Recording:
    """A parameter's weight_loader that notes the parameter's name when it is written."""

    inner: Any
    touched: set[str]
    name: str

    def __call__(self, param: Any, *args: Any) -> None:
        self.touched.add(self.name)
        self.inner(param, *args)


def _histories(drafts: list[int], parents: list[int] | None) -> list[list[int]]:
    """What each verification row has generated beyond the request's output: row 0 nothing, row
    j + 1 the drafts from the root down to draft j (a path: drafts[:j + 1])."""
    if parents is None:
        return [drafts[:j] for j in range(len(drafts) + 1)]
    out: list[list[int]] = [[]]
    for j, parent in enumerate(parents):
        out.append(out[parent + 1] + [drafts[j]])
    return out


def _bitmask_rows(bitmask: torch.Tensor | None, reqs: list[ScheduledRequest]) -> torch.Tensor | None:
    """The sampled rows' grammar masks, in their order; a row without a grammar allows every token."""
    if bitmask is None:
        return None
    index = torch.tensor([-1 if r.grammar_row is None else r.grammar_row for r in reqs])
    rows = bitmask[index.clamp(min=0)]
    rows[index < 0] = -1
    return rows


class ModelRunner:
    def __init__(self, launch: LaunchContext, rank: int | None = None, world_size: int | None = None,
                 communicator: Communicator | None = None) -> None:
        self.launch = launch
        self.config = launch.config
        self.source = launch.source
        sel = launch.selection
        self.platform = sel.platform
        self.device = torch.device(self.platform.device_type)
        self.attn_backend = sel.component("attention")()
        self.graph_runner = sel.component("graph_runners")()
        rank = self.rank = launch.rank if rank is None else rank
        world = launch.world_size if world_size is None else world_size
        redundant = self.config.eplb.redundant_experts_num if self.config.eplb.enable_eplb else None
        dp = attention_dp_size(self.config)
        if dp > 1:  # attention data parallelism: each rank's attention whole, the experts over all ranks
            self.pctx = ParallelContext(0, 1, communicator or launch.communicator, world, redundant,
                                        dp_size=dp, dp_rank=rank)
        else:
            self.pctx = ParallelContext(rank, world, communicator or launch.communicator,
                                        expert_parallel_size(self.config), redundant)
        self.dp_blocks = 0
        """Attention DP: the blocks of the engine's pool this rank holds (its DP rank's range of block
        ids, dp_rank * dp_blocks ..); the cache has one more, a scratch block for idle steps."""
        self.eplb_interval = self.config.eplb.eplb_update_interval if self.config.eplb.enable_eplb else 0
        """Steps between EPLB re-placements (0: no EPLB)."""
        self.eplb_steps = 0
        self.balanced: list[tuple[int, FusedMoE]] = []
        """EPLB: (layer index, experts) of every sparse layer."""
        self.dtype = resolve_dtype(self.config.device.dtype, self.source.hf_config, self.platform,
                                   self.source.gguf_file is not None)
        self.block_size = self.config.kv_cache.block_size
        self.sampler = Sampler()
        self.kv_caches: list[torch.Tensor] = []
        self.kv_connectors: dict[str, KVConnector] = {}
        """The KV connectors this launch selected, by name: "host" (--host_blocks_factor / --swap_space),
        "mooncake_store" (--enable_kvcache_store), "mooncake_transfer" (PD)."""
        self.kv_moves = KVMoves(self.kv_connectors, self.pctx, self.device)
        """PD: the pulls and pushes started and not yet over on every rank."""
        self.layer_batches = self.config.kv_cache_store.layers_wise_copy_batchs
        """--layers_wise_copy_batchs: a layer-wise connector's loads go in this many groups of layers."""
        self._loads: list[LayerwiseLoad] = []
        """The step's loads still copying (model_executor/layerwise.py)."""
        self._kv_failed: dict[str, str] = {}
        """The step's requests whose blocks a connector's apply could not bring in (not a pull)."""
        self._handed: dict[str, PushingCaches] = {}
        """The step's layer-wise pushes, by connector (how many groups each handed over so far)."""
        self.generators: dict[str, torch.Generator] = {}
        self.pooler = Pooler(lambda hidden: self.model.compute_logits(hidden))
        """Embedding and scoring requests: pooled from the final hidden states instead of sampled."""
        self.model: Any = None
        self.weight_bytes = 0
        self.profiler = None
        self.load_seconds = 0.0
        self.checkpoint_reads = ReadStats()
        self.drafter: Any = None
        """Speculative decoding with a draft model (spec_decode/draft.py): loaded with the target."""
        self.mm: MultiModalRunner | None = None
        """A vision-language model's encoder, encoder cache and M-RoPE positions (mm_encoder.py)."""

    # -- set-up ----------------------------------------------------------------------------
    def load_model(self) -> None:
        ops.activate(self.launch.selection.family, self.platform.default_impl)
        try:
            quant, quant_method = checkpoint_methods(self.config.fastdeploy.quantization, self.source.hf_config)
            method = select_linear_method(None if quant else self.config.fastdeploy.quantization)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        cls = get_model_class(self.launch.selection, self.source.architectures,
                              str(self.source.gguf_file or self.source.folder))
        started = time.perf_counter()
        with torch.device(self.device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(self.dtype)
            try:
                model = cls(self.source.hf_config, self.pctx, self.launch.max_model_len)
                if quant is not None:
                    attach_quantized(model, quant, getattr(model, "stacked", {}))
            except ValueError as exc:
                raise ConfigError(f"--model: {self.source.folder}: {exc}") from None
            finally:
                torch.set_default_dtype(previous)
        if self.pctx.ep_size > 1:
            self._check_expert_parallel(model)
        refused = getattr(model, "launch_refused", None)  # e.g. MoE experts: no linear method covers them
        if refused is not None and (reason := refused(self.config.fastdeploy.quantization, quant,
                                                      self.source.gguf_file)):
            raise ConfigError(reason)
        expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        where = self.source.gguf_file or self.source.folder
        reads = ReadStats()
        try:
            loaded = model.load_weights(iter_weights(self.source, self.config.fastdeploy.load_choices, reads))
        except KeyError as exc:
            raise ConfigError(f"--model: {where} holds tensor {exc.args[0]!r}, which the "
                              f"{type(model).__name__} architecture does not have") from None
        except ValueError as exc:
            raise ConfigError(f"--model: {where}: {exc}") from None
        missing = sorted(expected - loaded)
        if missing:
            shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
            raise ConfigError(f"--model: {where} is missing weights: {shown} (truncated or incomplete checkpoint?)")
        if self.config.execution.enable_attn_dp_weight_sharding:
            saved = shard_attention_weights(model, self.pctx)
            logger.info("--enable_attn_dp_weight_sharding: this rank keeps 1/%d of the attention weights (%.1f MiB "
                        "less), gathered layer by layer", self.pctx.dp_size, saved / 2**20)
        try:
            prepare_linears(model, method)
            if method is not None and (self.config.fastdeploy.quantization or self._prepack_experts()):
                prepare_experts(model, method)  # MoE experts, as the linears
            if quant_method is not None:
                prepare_quantized(model, quant_method)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.model = model.eval()
        if hasattr(model, "encode_images"):
            self.mm = MultiModalRunner(model, self.config.model.max_encoder_cache_size * 2**20, self.pctx,
                                       self.config.parallel.enable_mm_encoder_dp)
        self.weight_bytes = model_bytes(model)
        self.load_seconds = time.perf_counter() - started
        self.checkpoint_reads = reads
        spec = resolve_spec(self.config)
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModel(self, spec)
            self.drafter.load()
        logger.info("loaded %s (%s, %.1f MiB of weights, %s%s) in %.2fs; --load_choices %s handed "
                    "the weight loaders %.1f of the checkpoint's %.1f MiB", type(model).__name__, where, self.weight_bytes / 2**20,
                    str(self.dtype).removeprefix("torch."),
                    f", linear method {(quant_method or method).name}" if quant_method or method else "",
                    self.load_seconds, self.config.fastdeploy.load_choices, reads.read / 2**20, reads.stored / 2**20)

    def _prepack_experts(self) -> bool:
        """Unquantized MoE experts go through the platform's linear method too (the CPU's prepacked
        oneDNN weights: a Qwen3-MoE-shaped decode step of 64 sequences, 60 -> 51 ms), except where the
        float experts are needed: weight reload (--dynamic_load_weight), EPLB's moves, and a compiled
        decode step (which calls the float experts' op whole)."""
        cfg = self.config
        return not (cfg.fastdeploy.dynamic_load_weight or cfg.eplb.enable_eplb or cfg.execution.enable_graph)

    def _check_expert_parallel(self, model: Any) -> None:
        flag = f"--ep_size={self.pctx.ep_size}"
        if not any(isinstance(m, FusedMoE) for m in model.modules()):
            raise ConfigError(f"{flag}: {type(model).__name__} has no experts to shard (expert parallelism is for "
                              f"mixture-of-experts models)")
        if self.eplb_interval:
            if self.config.fastdeploy.quantization:
                raise ConfigError(f"--enable_eplb with --quantization={self.config.fastdeploy.quantization}: moving "
                                  f"prepared (quantized) experts between ranks is not built; use float experts")
            self.balanced = [(int(name.split(".layers.")[1].split(".")[0]), m) for name, m in model.named_modules()
                             if isinstance(m, FusedMoE)]
        comm = self.pctx.communicator
        if comm is not None and not type(comm).supports_all_to_all():
            raise ConfigError(f"{flag}: the communicator {type(comm).__name__} does not implement all_to_all, "
                              f"which dispatches tokens to their experts' ranks")

    def cache_layout(self, model: Any, num_blocks: int) -> CacheLayout:
        """`model`'s KV cache tensors here (the target's or a draft model's), per --kv_cache_dtype."""
        return cache_layout(model, self.attn_backend, num_blocks, self.block_size, self.dtype,
                            self.config.kv_cache.kv_cache_dtype)

    def kv_bytes_per_block(self) -> int:
        """Per block of the cache: the target's K/V (and their scales, quantized), plus a draft model's
        when one runs."""
        own = self.cache_layout(self.model, 1).bytes_per_block
        return own + (self.drafter.kv_bytes_per_block() if self.drafter is not None else 0)

    def activation_peak_bytes(self, num_tokens: int) -> int:
        """Peak activation for a step of `num_tokens`: hidden states, q/k/v, MLP intermediates and
        the fp32 logits of the sampled rows (profiled shapes, not allocator statistics, so it
        holds on every platform)."""
        cfg = self.source.hf_config
        elt = torch.empty((), dtype=self.dtype).element_size()
        per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size) * elt
        seqs = min(num_tokens, self.config.scheduler.max_seqs_per_batch)
        return num_tokens * per_token + seqs * cfg.vocab_size * 4 * 3

    def memory_profile(self) -> RankMemory:
        """What this rank holds, for the launcher's KV cache plan (engine/memory_budget.py): its
        memory's figures, weights, activation peak and bytes per block. Sizes nothing itself."""
        free, total = self.platform.memory_info()
        per_block = self.kv_bytes_per_block()
        if self.pctx.dp_size > 1:  # a block of the engine's pool lives on one DP rank: 1 / dp of one here
            per_block = -(-per_block // self.pctx.dp_size)
        return RankMemory(device=device_key(self.platform.device_type), total=total, free=free,
                          weights=self.weight_bytes + (self.drafter.weight_bytes if self.drafter is not None else 0),
                          activation_peak=self.activation_peak_bytes(self.config.scheduler.max_tokens_per_batch),
                          kv_bytes_per_block=per_block)

    def initialize_kv_connectors(self, host_blocks: int) -> None:
        """Build the selected KV connectors over this rank's caches: the "host" one with `host_blocks`
        slots (the engine sized them: kv_cache/host_tier.py), the others with none of their own."""
        for group, entry in self.launch.selection.components.items():
            if not group.startswith("kv_connectors."):
                continue
            name = group.split(".", 1)[1]
            slots = host_blocks if name == "host" else 0
            conn = self.kv_connectors[name] = entry.obj(self.launch, self.kv_caches,
                                                         self.attn_backend.cache_block_dim, slots)
            if conn.nbytes:
                logger.info("KV connector %s: %d blocks, %.1f MiB on this rank", name, slots, conn.nbytes / 2**20)

    def kv_connector_info(self) -> dict[str, dict[str, object]]:
        return {name: conn.info() for name, conn in self.kv_connectors.items()}

    def _apply_kv_transfers(self, so: SchedulerOutput) -> None:
        """Run the step's block moves; start its pulls (`self.kv_moves` follows them until they end)."""
        for name, transfers in so.kv_transfers.items():
            conn = self.kv_connectors[name]
            if transfers.load and conn.layerwise and not transfers.pulls and not transfers.data:
                if transfers.save:  # saves first: a block saved now may be a load's destination
                    conn.save(transfers.save)
                self._loads.append(LayerwiseLoad(conn, transfers.load, len(self.kv_caches), self.layer_batches))
                continue
            failed = conn.apply(transfers)
            pulls = [p.request_id for p in transfers.pulls]
            if pulls:
                self.kv_moves.started(conn, pulls, failed, "pull")
            # a failure of another request's blocks ends it too (rank 0's word, as the engine reads it)
            self._kv_failed.update({r: why for r, why in failed.items() if r not in pulls})

    def _push_layerwise(self, so: SchedulerOutput, inputs: StepInputs) -> None:
        """PD PUSH, an eager forward: a connector that pushes layer by layer (`push_groups`) gets each
        group of layers as soon as the forward is past it."""
        for name, transfers in so.kv_transfers.items():
            conn = self.kv_connectors[name]
            if transfers.pushes and conn.push_groups > 0:
                pushes = transfers.pushes
                inputs.ctx.kv_caches = self._handed[name] = PushingCaches(
                    inputs.ctx.kv_caches, layer_groups(len(self.kv_caches), conn.push_groups),
                    lambda layers, c=conn, p=pushes: c.push_layers(p, layers))

    def _push_kv(self, so: SchedulerOutput) -> None:
        """After the forward: start writing the blocks it completed to the instances that reserved them
        (PD, PUSH)."""
        for name, transfers in so.kv_transfers.items():
            if transfers.pushes:
                conn = self.kv_connectors[name]
                failed = conn.after_forward(transfers)
                self.kv_moves.started(conn, [p.request_id for p in transfers.pushes], failed, "push")

    def initialize_cache(self, num_blocks: int, host_blocks: int = 0) -> None:
        """Allocate the caches, then capture the decode graphs (`--enable_graph`), all of them now,
        before any request. A failed capture turns graphs off with a warning: the engine serves
        eagerly. Under attention DP `num_blocks` is the engine's pool: this rank holds its 1 / dp share
        of it, and a scratch block."""
        if self.pctx.dp_size > 1:
            self.dp_blocks = num_blocks // self.pctx.dp_size
            num_blocks = self.dp_blocks + 1
        layout = self.cache_layout(self.model, num_blocks)
        # empty, not zeros: pages are committed as blocks are first written; backends never read
        # a slot that has not been written for the sequence reading it
        try:
            self.kv_caches = [torch.empty(layout.shape, dtype=layout.dtype, device=self.device)
                              for _ in range(layout.num_layers)]
            if self.drafter is not None:
                self.drafter.initialize_cache(num_blocks)
        except (RuntimeError, MemoryError) as exc:  # the device's out-of-memory errors are RuntimeErrors
            self.kv_caches = []
            want = num_blocks * self.kv_bytes_per_block()
            raise ConfigError(f"allocating the KV cache ({num_blocks} blocks, {want / 2**20:.1f} MiB on this rank) "
                              f"failed: {exc}; {self._sizing_flags()}") from None
        self.initialize_kv_connectors(host_blocks)
        self._capture_graphs(graph_batch_sizes(self.config))

    def _sizing_flags(self) -> str:
        """What to change when the cache does not fit, naming the flag that sized it."""
        kvc, fd = self.config.kv_cache, self.config.fastdeploy
        if fd.num_gpu_blocks_override:
            return f"lower --num_gpu_blocks_override={fd.num_gpu_blocks_override}"
        if kvc.max_cache_size:
            return f"lower --max_cache_size={kvc.max_cache_size}"
        return f"lower --max_memory_utilization={kvc.max_memory_utilization} or set --max_cache_size"

    @torch.inference_mode()
    def _capture_graphs(self, sizes: list[int]) -> None:
        started = time.perf_counter()
        try:
            self.graph_runner.capture(self._forward, sizes, self._decode_inputs)
        except Exception as exc:  # graphs are an optimization: serve without them
            logger.warning("decode graph capture failed, running every step eagerly: %s: %s", type(exc).__name__, exc)
            self.graph_runner.capture(self._forward, [], self._decode_inputs)
            return
        if sizes:
            logger.info("decode graphs for batch sizes up to %d built in %.1fs", sizes[-1],
                        time.perf_counter() - started)

    def _decode_inputs(self, batch: int) -> StepInputs:
        """A decode step of `batch` sequences for capturing graphs at start-up: every sequence at
        position 1 of block 0 (no request owns a block yet), its table as wide as the longest
        sequence's (max_model_len) so no later step outgrows a captured graph."""
        width = -(-self.launch.max_model_len // self.block_size)
        inputs = AttentionInputs(query_lens=[1] * batch, context_lens=[1] * batch, block_tables=[[0] * width] * batch,
                                 block_size=self.block_size)
        ctx = ForwardContext(self.attn_backend, self.attn_backend.build_metadata(inputs, self.device), self.kv_caches)
        return StepInputs(torch.zeros(batch, dtype=torch.long, device=self.device),
                          torch.ones(batch, dtype=torch.long, device=self.device), ctx)

    # -- one step --------------------------------------------------------------------------
    def _forward(self, inputs: StepInputs) -> torch.Tensor:
        if inputs.inputs_embeds is not None:
            return self.model(inputs.input_ids, inputs.positions, inputs.ctx, inputs_embeds=inputs.inputs_embeds)
        return self.model(inputs.input_ids, inputs.positions, inputs.ctx)

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        """A request with a seed samples from its own generator, kept across steps (and across a
        preemption), so its output does not depend on what else is in the batch."""
        seed = r.sampling.params.seed
        if r.sampling.params.greedy:
            return None
        if seed is None:
            if self.drafter is None or self.pctx.tp_size == 1:
                return None
            # a draft model's sampled drafts feed its sharded forward: every rank must draw alike
            seed = rank_seed(r.request_id)
        gen = self.generators.get(r.request_id)
        if gen is None:
            gen = self.generators[r.request_id] = torch.Generator(device=self.device)
            gen.manual_seed(seed + r.sampling.seed_offset)
        return gen

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> RunnerOutput:
        for request_id in so.finished_request_ids:
            self.generators.pop(request_id, None)
        if self.drafter is not None:
            self.drafter.forget(so.finished_request_ids)
        self.pooler.forget(so.finished_request_ids)
        if self.mm is not None:
            self.mm.forget(so.finished_request_ids)
        try:
            t_kv = time.perf_counter()
            if so.kv_transfers is not None:
                self._apply_kv_transfers(so)
            kv_s = {"kv_transfer": time.perf_counter() - t_kv} if so.kv_transfers is not None else {}
            out = self._execute(so, kv_s)
        finally:
            loads, self._loads = self._loads, []
            for load in loads:  # a step that ended early (nothing of this rank's to run) still lands them
                load.join()
            handed, self._handed = self._handed, {}
            if so.kv_transfers is not None:  # a step that failed before a move started: it fails
                self.kv_moves.not_started(so.kv_transfers, {name for name, c in handed.items() if c.next})
        pushed = [p.request_id for t in (so.kv_transfers or {}).values() for p in t.pushes]
        # every rank, every step: the ranks agree on which moves ended (a step's own pushes waited for)
        t_wait = time.perf_counter()
        out.kv_done = self.kv_moves.poll(pushed)
        if self._kv_failed:
            out.kv_done, self._kv_failed = {**(out.kv_done or {}), **self._kv_failed}, {}
        if pushed:  # what the pushes held the step up after its forward, their waited-for tail included
            out.timings["kv_push"] = out.timings.get("kv_push", 0.0) + time.perf_counter() - t_wait
        return out

    def _execute(self, so: SchedulerOutput, kv_s: dict[str, float]) -> RunnerOutput:
        reqs = so.requests
        if not reqs:
            return RunnerOutput([], [], [], [], timings=kv_s)
        if self.pctx.dp_size > 1:
            reqs = self._own_requests(reqs)
            if not reqs:  # the experts' all_to_all needs every rank: run a token on the scratch block
                self._idle_step()
                return RunnerOutput([], [], [], [], expert_load=self._balance_experts() if self.eplb_interval else None)
        t0 = time.perf_counter()
        comm0 = getattr(self.pctx.communicator, "seconds", None)
        inputs = self._prepare(reqs)
        if self.mm is not None:
            inputs = self.mm.prepare(reqs, inputs)
        if self._loads:
            if inputs.ctx.metadata.decode_only:  # a step a graph may replay: it reads no list, so all first
                for load in self._loads:
                    load.join()
            else:  # eager: layer l's attention waits for its group of the loads
                inputs.ctx.kv_caches = WaitingCaches(self.kv_caches, self._loads)
        if so.kv_transfers is not None and not inputs.ctx.metadata.decode_only:
            self._push_layerwise(so, inputs)
        t1 = time.perf_counter()
        if inputs.inputs_embeds is not None or inputs.positions.dim() == 2:  # image tokens: never a graph
            hidden = self._forward(inputs)
        else:
            hidden = self.graph_runner.run(self._forward, inputs)
        t2 = time.perf_counter()
        if self._loads:
            for load in self._loads:
                load.join()
            kv_s["kv_load"] = sum(load.estimate for load in self._loads)
        ends = torch.tensor([len(r.new_token_ids) for r in reqs]).cumsum(0).tolist()
        sampled = self._sample(reqs, hidden, ends, so.grammar_bitmask)
        pooled = self.pooler(reqs, hidden, ends) if any(r.pooling is not None for r in reqs) else None
        prompt_lps: list[list[TokenLogprobs | None] | None] = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if r.want_prompt_logprobs:
                prompt_lps[i] = self._prompt_logprobs(r, hidden[ends[i] - len(r.new_token_ids):ends[i]])
        t3 = time.perf_counter()
        if so.kv_transfers is not None and any(t.pushes for t in so.kv_transfers.values()):
            t_push = time.perf_counter()
            self._push_kv(so)
            kv_s["kv_push"] = time.perf_counter() - t_push
        drafts = None
        if self.drafter is not None:
            drafts = self.drafter.propose(reqs, [sampled[i][0] if i in sampled else [] for i in range(len(reqs))])
        t4 = time.perf_counter()
        expert_load = self._balance_experts() if self.eplb_interval else None
        return RunnerOutput(
            request_ids=[r.request_id for r in reqs],
            sampled_token_ids=[sampled[i][0] if i in sampled else [] for i in range(len(reqs))],
            logprobs=[sampled[i][1] if i in sampled else None for i in range(len(reqs))],
            prompt_logprobs=prompt_lps, pooled=pooled, spec_token_ids=drafts,
            timings={"prepare": t1 - t0, "forward": t2 - t1, "sample": t3 - t2, **kv_s,
                     **({"draft": t4 - t3} if self.drafter is not None else {}),
                     **({"comm": self.pctx.communicator.seconds - comm0} if comm0 is not None else {})},
            expert_load=expert_load)

    def _own_requests(self, reqs: list[ScheduledRequest]) -> list[ScheduledRequest]:
        """Attention DP: the step's requests whose blocks are this rank's (the engine's KV manager keeps a
        request's blocks in one DP rank's range), with their tables in this rank's cache's ids."""
        lo, hi = self.pctx.dp_rank * self.dp_blocks, (self.pctx.dp_rank + 1) * self.dp_blocks
        mine = []
        for r in reqs:
            if not lo <= r.block_ids[0] < hi:
                continue
            if not all(lo <= b < hi for b in r.block_ids):
                raise RuntimeError(f"{r.request_id}: blocks {r.block_ids} span attention DP ranks")
            mine.append(replace(r, block_ids=[b - lo for b in r.block_ids]))
        return mine

    def _idle_step(self) -> None:
        """A step with no request of this rank: one token at position 0 of the scratch block, its
        expert choices not counted as load."""
        for _, experts in self.balanced:
            experts.placement.counting = False
        try:
            self.graph_runner.run(self._forward, self._idle_inputs())
        finally:
            for _, experts in self.balanced:
                experts.placement.counting = True

    def _idle_inputs(self) -> StepInputs:
        inputs = AttentionInputs(query_lens=[1], context_lens=[0], block_tables=[[self.dp_blocks]],
                                 block_size=self.block_size)
        ctx = ForwardContext(self.attn_backend, self.attn_backend.build_metadata(inputs, self.device), self.kv_caches)
        return StepInputs(torch.zeros(1, dtype=torch.long, device=self.device),
                          torch.zeros(1, dtype=torch.long, device=self.device), ctx)

    def _balance_experts(self) -> dict[str, Any]:
        """EPLB after a step: every `--eplb_update_interval` steps, re-place every sparse layer's
        experts (all ranks run the same steps, so they move together); then the counters."""
        self.eplb_steps += 1
        if self.eplb_steps % self.eplb_interval == 0:
            moved = [m.rebalance() for _, m in self.balanced]
            if self.rank == 0:
                logger.info("EPLB: experts re-placed after %d steps (%d slots changed over %d layers)",
                            self.eplb_steps, sum(moved), len(moved))
        placements = [m.placement for _, m in self.balanced]
        return {"layers": [i for i, _ in self.balanced], "expert": [p.total.tolist() for p in placements],
                "replica": [p.replica_total.tolist() for p in placements],
                "placement": [p.phys2log.tolist() for p in placements],
                "rank_window": [p.rank_load().tolist() for p in placements],
                "rebalances": placements[0].rebalances if placements else 0}

    def _prepare(self, reqs: list[ScheduledRequest]) -> StepInputs:
        """Flatten the step's new tokens and build the attention metadata."""
        ids: list[int] = []
        positions: list[int] = []
        trees: list[list[int] | None] = []
        for r in reqs:
            ids += r.new_token_ids
            start = r.num_computed_tokens
            if r.spec_parents is None:
                positions += range(start, start + len(r.new_token_ids))
                trees.append(None)
                continue
            # a draft tree: each draft at its depth (RoPE), attending to its ancestors only
            known = len(r.new_token_ids) - r.num_spec_tokens
            tree = list(range(-1, known - 1)) + [known - 1 if p < 0 else known + p for p in r.spec_parents]
            depth: list[int] = []
            for p in tree:
                depth.append(0 if p < 0 else depth[p] + 1)
            positions += [start + d for d in depth]
            trees.append(tree)
        bs = self.block_size
        # a table may run past the step's tokens (a draft model's lookahead slots): pass only the step's blocks
        inputs = AttentionInputs(query_lens=[len(r.new_token_ids) for r in reqs],
                                 context_lens=[r.num_computed_tokens for r in reqs],
                                 block_tables=[r.block_ids[:-(-(r.num_computed_tokens + len(r.new_token_ids)) // bs)]
                                               for r in reqs], block_size=bs,
                                 tree_parents=trees if any(t is not None for t in trees) else None)
        meta = self.attn_backend.build_metadata(inputs, self.device)
        ctx = ForwardContext(self.attn_backend, meta, self.kv_caches)
        return StepInputs(torch.tensor(ids, device=self.device), torch.tensor(positions, device=self.device), ctx)

    def _sample(self, reqs: list[ScheduledRequest], hidden: torch.Tensor, ends: list[int],
                grammar_bitmask: torch.Tensor | None = None) -> dict[int, tuple[list[int], list[TokenLogprobs] | None]]:
        """Sample the requests that finish their step's tokens: batch index -> (tokens, their logprobs
        or None). Requests with a grammar sample under their row of `grammar_bitmask`; requests with
        drafts (speculative decoding) verify them and take 1 to k + 1 tokens."""
        sample_idx = [i for i, r in enumerate(reqs) if r.sample and r.pooling is None]
        if not sample_idx:
            return {}
        plain = [i for i in sample_idx if not reqs[i].num_spec_tokens]
        spec = [i for i in sample_idx if reqs[i].num_spec_tokens]
        positions = [ends[i] - 1 for i in plain]
        for i in spec:
            positions += range(ends[i] - 1 - reqs[i].num_spec_tokens, ends[i])
        logits = self.model.compute_logits(hidden[torch.tensor(positions, device=self.device)])
        out: dict[int, tuple[list[int], list[TokenLogprobs] | None]] = {}
        if plain:
            rows = [SamplingRow(reqs[i].sampling.params, self._generator(reqs[i]), reqs[i].prompt_token_ids,
                                reqs[i].output_token_ids) for i in plain]
            tokens, lps = self.sampler(logits[:len(plain)], rows,
                                       _bitmask_rows(grammar_bitmask, [reqs[i] for i in plain]))
            out.update((i, ([t], None if lp is None else [lp])) for i, t, lp in zip(plain, tokens, lps))
        if spec:
            out.update(self._verify([reqs[i] for i in spec], spec, logits[len(plain):]))
        return out

    def _verify(self, reqs: list[ScheduledRequest], index: list[int],
                logits: torch.Tensor) -> dict[int, tuple[list[int], list[TokenLogprobs] | None]]:
        """Speculative decoding: each request's k + 1 rows of `logits` (row j after the first j drafts)
        verified against its drafts (spec_decode/rejection.py); its logprobs are the target's."""
        rows: list[SamplingRow] = []
        for r in reqs:
            drafts = r.new_token_ids[-r.num_spec_tokens:]
            gen = self._generator(r)
            rows += [SamplingRow(r.sampling.params, gen, r.prompt_token_ids, r.output_token_ids + history)
                     for history in _histories(drafts, r.spec_parents)]
        processed, raw_logprobs = self.sampler.prepare(logits, rows)
        out = {}
        first = 0
        for i, r in zip(index, reqs):
            k = r.num_spec_tokens
            drafts = r.new_token_ids[-k:]
            q = self.drafter.draft_probs(r.request_id, drafts) if self.drafter is not None else None
            if r.spec_parents is not None:
                tokens, taken = verify_tree(processed[first:first + k + 1], drafts, r.spec_parents,
                                            r.sampling.params, rows[first].generator)
            else:
                tokens = verify(processed[first:first + k + 1], drafts, r.sampling.params, rows[first].generator, q)
                taken = list(range(len(tokens)))
            lps = None
            if raw_logprobs is not None and wants_logprobs(rows[first]):
                chosen = torch.tensor(tokens, device=raw_logprobs.device)
                lps = gather_logprobs(raw_logprobs[[first + t for t in taken]], chosen,
                                      [r.sampling.params.logprobs or 0] * len(tokens))
            out[i] = (tokens, lps)
            first += k + 1
        return out

    def _prompt_logprobs(self, r: ScheduledRequest, hidden: torch.Tensor) -> list[TokenLogprobs | None]:
        """Logprobs of prompt tokens start+1 .. end (position j predicts token j + 1)."""
        start = r.num_computed_tokens
        prompt = r.prompt_token_ids
        last = min(start + len(r.new_token_ids), len(prompt) - 1)
        if last <= start:
            return []
        logprobs = self.model.compute_logits(hidden[: last - start]).float().log_softmax(-1)
        targets = torch.tensor(prompt[start + 1:last + 1], device=logprobs.device)
        k = r.sampling.params.prompt_logprobs or 0
        return list(gather_logprobs(logprobs, targets, [k] * len(targets)))

    @torch.inference_mode()
    def update_weights(self, update: WeightUpdate) -> int:
        """Replace the parameters `update` names, in place, between steps (captured graphs hold the
        same storage, so they see the new values). All or nothing: the tensors are first loaded into a
        copy of the model on the meta device, so a name or shape that does not fit changes nothing.
        Returns how many tensors were read."""
        if self.config.fastdeploy.quantization:
            raise WeightUpdateError("--quantization", f"weights cannot be reloaded into a model quantized on load "
                                    f"(--quantization={self.config.fastdeploy.quantization})")
        if getattr(self.source.hf_config, "quantization_config", None) is not None:
            raise WeightUpdateError("path", "weights cannot be reloaded into a quantized checkpoint's model "
                                            "(its layers hold packed GPTQ / AWQ / FP8 weights)")
        tensors = list(update.tensors())
        with torch.device("meta"):
            dry = type(self.model)(self.source.hf_config, self.pctx, self.launch.max_model_len)
        touched, complete = _load_checked(dry, tensors, type(self.model).__name__)
        prepared = unpack_for_reload(self.model, dry, touched, complete)
        _load_checked(self.model, tensors, type(self.model).__name__)
        repack_after_reload(self.model, prepared)
        return len(tensors)

    def start_profile(self) -> None:
        """Start this rank's online profiler (--enable_online_profile) on the calling thread, the one
        that runs this rank's steps."""
        from heterollm.profiling import RankProfiler, trace_dir

        if self.profiler is None:
            self.profiler = RankProfiler(self.platform, self.config.profile.profile_backend, trace_dir(self.config),
                                         self.rank)
        self.profiler.start()

    def stop_profile(self) -> list[str]:
        """Stop it and write this rank's trace; the files written."""
        if self.profiler is None:
            raise RuntimeError("no profile is being recorded")
        return self.profiler.stop()

    def shutdown(self) -> None:
        for conn in self.kv_connectors.values():
            conn.close()
        self.kv_connectors = {}
        self.kv_caches = []
        self.drafter = None
        self.model = None
