"""The synchronous engine: admission, the step loop, and output processing (incremental
detokenization, stop conditions, n > 1 fan-out). Deterministic given seeds.

With `--enable_schedule_overlap` a step runs on a worker thread while the engine schedules the next
one and turns the previous one's tokens into outputs; the tokens are the same as without it.
"""
from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from heterollm.config import ConfigError, HeterollmConfig
from heterollm.config.checks import attention_dp_size, engine_replicas
from heterollm.config.scheduling import SchedulerConfig
from heterollm.engine.admission import AdmissionLimits, admit_params, best_of
from heterollm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from heterollm.scheduler.request import Request, RequestRejected, RequestStatus
from heterollm.engine.memory_budget import KVPlan, KVSizing, mib, plan_kv_cache, plan_warnings
from heterollm.engine import reservations
from heterollm.engine.step_profiler import StepProfiler
from heterollm.interfaces import ExecutorDead, RunnerOutput, SchedulerOutput
from heterollm.kv_cache import DataParallelKVCacheManager, KVCacheManager
from heterollm.kv_cache.events import make_kv_event_publisher
from heterollm.kv_cache.host_tier import host_available_bytes, host_slots_for, host_tier_flag
from heterollm.kv_cache.pd import HOLD_TIMEOUT_S, pd_role, peers_from
from heterollm.kv_cache.store_tier import (SEGMENT_BYTES as STORE_SEGMENT_BYTES, StoreTier, close_store, key_prefix,
                                           open_store)
from heterollm.model_executor.loader import ModelSource, resolve_model
from heterollm.model_executor.registry import check_model_support
from heterollm.model_executor.runner import LaunchContext, model_max_len, resolve_dtype
from heterollm.model_executor.weight_update import WeightUpdate, WeightUpdateError
from heterollm.multimodal import MultiModalItem
from heterollm.multimodal.processor import MultiModalInputs
from heterollm.plugins import make_plugin_manager
from heterollm.plugins.launch import launch_selection
from heterollm.pooling import PoolingParams
from heterollm.pooling.task import build_setup
from heterollm.sampling import SamplingParams, StructuredOutputsParams
from heterollm.sampling.structured import GrammarState, StructuredOutputManager
from heterollm.scheduler import Scheduler
from heterollm.scheduler.scheduler import pd_moves
from heterollm.spec_decode import check_spec_support, make_proposer, resolve_spec
from heterollm.spec_decode.stats import SpecStats
from heterollm.engine.latency_profile import latency_targets, profile_step_time, profile_token_budget, warm_up
from heterollm.scheduler.policy import SchedulingPolicy
from heterollm.scheduler.prefill_limits import prefill_limits
from heterollm.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger("heterollm.engine")

MOVE_POLL_S = 0.002
"""PD: the pause before a step that only polls the K/V moves under way (nothing else to run)."""


@dataclass
class _Child:
    request: Request
    detok: IncrementalDetokenizer
    index: int
    emitted_chars: int = 0
    emitted_tokens: int = 0
    final_text: str | None = None


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float
    children: list[_Child] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return all(c.request.finished for c in self.children)


@dataclass
class _PDAdmission:
    """What a request's kv_transfer_params do to it (kv_cache/pd.py)."""

    hold: bool = False
    pull: tuple[Any, list[int], float] | None = None
    first_token: int | None = None
    push: tuple[Any, list[int], int, float] | None = None
    """PUSH, PREFILL: (the decode instance's ranks, its reserved blocks, how many it had cached, when the
    reservation expires: time.time())."""
    push_reservation: str | None = None
    reservation: str | None = None
    """PUSH, DECODE: the reservation whose blocks the prefill instance filled."""

    def apply(self, request: Request) -> None:
        request.kv_hold = self.hold
        request.kv_push = self.push
        request.pd_reservation = self.push_reservation
        if self.pull is not None or self.reservation is not None:
            request.kv_pull = self.pull
            request.output_token_ids = [self.first_token]
            request.pd_first_token = True


class LLMEngine:
    def __init__(self, config: HeterollmConfig, dp_rank: int = 0) -> None:
        """`dp_rank`: which of the --dp_size replicas behind one server this engine is (its KV
        events go to the base ports + dp_rank)."""
        self.config = config
        self.dp_rank = dp_rank
        self.kv_pull_blocks = 0
        """PD, DECODE: blocks pulled from prefill instances so far."""
        self.kv_pull_seconds = 0.0
        """Seconds the pulls took, from the start of the step that started each to the step that saw it
        end."""
        self.kv_push_blocks = 0
        """PD PUSH, PREFILL: blocks written into decode instances' reservations so far."""
        self.kv_push_seconds = 0.0
        """Seconds the answers waited for their pushes: from the end of the step whose forward completed
        the prompt (its layers were pushed beside it) to the step that saw the writes end."""
        self._moves: dict[str, tuple[str, int, float, float]] = {}
        """PD: request id -> ("pull" / "push", its blocks, when the step that starts it was scheduled (a
        push: when that step ended), when the peer's hold on the blocks ends: time.time())."""
        self.engine_id = uuid.uuid4().hex
        """Names this engine to other instances (PD: remote_engine_id)."""
        self._pd_ranks: list[dict[str, Any]] | None = None
        """PD: the ranks' transfer endpoints and cache addresses (asked once, at start)."""
        self._reservation: tuple[str, Path] | None = None
        """(key, registry file) of this engine's entry in the host's memory registry, until shutdown."""
        self.selection = launch_selection(config, lambda: self._resolve_model().architectures)
        check_model_support(self.selection, self.source.hf_config, config.kv_cache.kv_cache_dtype)
        check_spec_support(self.selection, config)
        self.plugins = make_plugin_manager()
        """The general plugins' request hooks (`heterollm.plugins`), built once per engine."""
        self.dtype = resolve_dtype(config.device.dtype, self.source.hf_config, self.selection.platform,
                                   self.source.gguf_file is not None)
        """The weight/activation dtype `--dtype` resolves to (the runner resolves it identically)."""
        if not self.selection.platform.supports_dtype(str(self.dtype).removeprefix("torch.")):
            # a platform that cannot run the dtype at all refuses it in its validate; this one emulates it
            auto = resolve_dtype("auto", self.source.hf_config, self.selection.platform,
                                 self.source.gguf_file is not None)
            fewer = self.dtype.itemsize < auto.itemsize  # then a bandwidth-bound single stream may still gain
            logger.warning("--dtype %s: platform %s has no native %s, so its products run emulated: slower%s "
                           "(--dtype auto picks %s here)", config.device.dtype, self.selection.platform.name,
                           config.device.dtype, " for batches, though fewer weight bytes can still make one sequence "
                           "faster" if fewer else "", str(auto).removeprefix("torch."))
        hf = self.source.hf_config
        max_len = model_max_len(config, hf)
        if config.execution.random_seed >= 0:
            self.selection.platform.seed(config.execution.random_seed)
        launch = LaunchContext(config, self.selection, self.source, max_len)
        self.executor = self.selection.component("executors").create(launch)
        try:
            self._start(config, max_len, dp_rank)
        except BaseException:  # a half-built engine must leave no worker processes, reservation or store mount behind
            self.executor.shutdown()
            if getattr(self, "kv_store", None) is not None:
                close_store(config)
                self.kv_store = None
            self._release_reservation()
            raise

    def _plan_kv_cache(self, config: HeterollmConfig, max_len: int) -> KVPlan:
        """Size this replica's KV cache from its ranks' reports and the host's registry, record the
        reservation there (taken back at shutdown), and log it with the host's budget."""
        kvc = config.kv_cache
        sizing = KVSizing(kvc.max_memory_utilization, kvc.max_cache_size, config.fastdeploy.num_gpu_blocks_override,
                          engine_replicas(config), max_len, kvc.block_size)
        profiles = self.executor.memory_profile()
        self._reservation = (f"{id(self)}", reservations.registry_path())
        with reservations.host_registry(self._reservation[1]) as host:
            plan = plan_kv_cache(profiles, sizing, host.others())
            held = host.mine()
            host.hold(self._reservation[0], plan.reserved())
        for warning in plan_warnings(plan, held):
            logger.warning("%s", warning)
        for m in plan.memories:
            mine = held.get(m.device, 0) + m.reserved(plan.num_blocks)
            logger.info("KV cache: %d blocks of %d slots = %d tokens; %s: %s reserved (%d rank(s)), %s with weights "
                        "and activations; heterollm on this host: this process %s + others %s of the budget %s "
                        "(--max_memory_utilization=%s x %s total)", plan.num_blocks, kvc.block_size,
                        plan.num_blocks * kvc.block_size, m.device, mib(plan.num_blocks * m.per_block), m.ranks,
                        mib(m.reserved(plan.num_blocks)), mib(mine), mib(m.others), mib(m.budget),
                        kvc.max_memory_utilization, mib(m.total))
        return plan

    def kv_committed_bytes(self) -> int:
        """KV cache bytes whose pages are committed: on a platform that commits on first write
        (`Platform.idle_kv_budget_bytes` set: the CPU), the blocks the pool ever handed out times
        the bytes of a block over all ranks (a page a block shares with an untouched one may be
        committed too); elsewhere the whole reservation, resident from allocation."""
        if self.selection.platform.idle_kv_budget_bytes is None:
            return self.kv_plan.kv_bytes
        return self.kv.pool.num_touched * self.kv_plan.bytes_per_block

    def _release_reservation(self) -> None:
        if self._reservation is not None:
            reservations.release(*self._reservation)
            self._reservation = None

    def _resolve_model(self) -> ModelSource:
        self.source = resolve_model(self.config.model.model, self.config.fastdeploy.revision)
        return self.source

    def _start(self, config: HeterollmConfig, max_len: int, dp_rank: int) -> None:
        """Load the weights, size and allocate the KV cache, and build the scheduler around it."""
        self.kv_store = self._open_kv_store(config)
        """The KV cache store's engine side (--enable_kvcache_store); None without one."""
        self.executor.load_model()
        block_size = config.kv_cache.block_size
        self.kv_plan = self._plan_kv_cache(config, max_len)
        self._size_store_fetches()
        num_blocks = self.kv_plan.num_blocks
        dp = attention_dp_size(config)  # attention DP: a sequence's blocks are all on one rank
        if num_blocks < dp:
            raise ConfigError(f"--dp_size={dp}: the KV cache has {num_blocks} blocks, fewer than one per attention "
                              f"DP rank; raise --num_gpu_blocks_override or --max_cache_size")
        capacity = num_blocks // dp * block_size
        if capacity < max_len:
            logger.warning("the KV cache holds %d tokens, fewer than max_model_len %d; capping max_model_len",
                           capacity, max_len)
            max_len = capacity
        self.host_blocks = host_slots_for(config, num_blocks, self.kv_plan.bytes_per_block)
        """Slots of the host KV tier (--host_blocks_factor / --swap_space); 0 without one."""
        if self.host_blocks:
            self._check_host_tier_memory(config)
            self.executor.initialize_cache(num_blocks, self.host_blocks)
            logger.info("host KV tier: %d blocks (%.0f MiB over all ranks) behind the %d-block pool",
                        self.host_blocks, self.host_blocks * self.kv_plan.bytes_per_block / 2**20, num_blocks)
        else:
            self.executor.initialize_cache(num_blocks)
        self.num_blocks = num_blocks
        if "kv_connectors.mooncake_transfer" in self.selection.components:  # asked now: no step is in flight
            self._pd_ranks = [rank["mooncake_transfer"] for rank in self.executor.kv_connector_info()]
        self.max_model_len = max_len
        self.tokenizer = load_tokenizer(self.source.folder, self.source.gguf_file, config.fastdeploy.tokenizer,
                                        self.source.eos_token_ids, config.fastdeploy.chat_template)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.vocab_size = self.source.hf_config.vocab_size
        self.pooling = build_setup(config, self.source.hf_config, self.source.folder, self.tokenizer.hf,
                                   (self.source.architectures or [""])[0])
        self.multimodal = MultiModalInputs.for_launch(config, self.source, self.tokenizer.hf)
        """Images with a prompt (`multi_modal_data`): loaded and preprocessed here offline; under
        `heterollm serve` the API server does it and hands the items in (add_request's mm_items)."""
        """What this launch serves: generation, embeddings, scores (--task, --enable_qwen3_reranker)."""
        kvc = config.kv_cache
        idle_limit = None
        idle_bytes = self.selection.platform.idle_kv_budget_bytes
        if idle_bytes is not None and not (kvc.max_cache_size or config.fastdeploy.num_gpu_blocks_override):
            idle_limit = max(1, idle_bytes // self.kv_plan.bytes_per_block)
            if kvc.enable_prefix_cache and idle_limit < num_blocks:
                logger.info("prefix cache: at most %d freed blocks (%.0f MiB) stay cached beyond the working set; "
                            "--max_cache_size lets it use the whole cache", idle_limit, idle_bytes / 2**20)
        self.kv_events = make_kv_event_publisher(kvc.kv_events_config, dp_rank=dp_rank)
        """Publishes the prefix cache's BlockStored/BlockRemoved events over ZeroMQ (--kv_events_config)."""
        self.structured = self._structured_output_manager(config)
        """Compiles grammars and fills bitmasks (--guided_decoding_backend); None when it is off."""
        kv_args = dict(enable_prefix_cache=kvc.enable_prefix_cache, hash_seed=kvc.xxh3_128bits_seed,
                       record_events=self.kv_events is not None, idle_limit=idle_limit)
        self.kv = (DataParallelKVCacheManager(dp, num_blocks, block_size, **kv_args) if dp > 1
                   else KVCacheManager(num_blocks, block_size, host_slots=self.host_blocks, store=self.kv_store,
                                       **kv_args))
        latency = latency_targets(config)
        self.spec = resolve_spec(config)
        """Speculative decoding (spec_decode/), None when it is off."""
        self.proposer = make_proposer(self.spec) if self.spec is not None else None
        """The engine-side proposer (suffix, n-gram); None for a draft model (it runs on the workers)."""
        self.spec_stats = SpecStats()
        self.expert_load: dict[str, Any] | None = None
        """--enable_eplb: the last expert-load counters the runner reported (RunnerOutput.expert_load)."""
        self._spec_step: tuple[int, int, int] = (0, 0, 0)
        """The last step's (verifications, drafts, accepted), for --enable_profile_step_time."""

        def make_scheduler(sched: SchedulerConfig) -> Scheduler:
            return Scheduler(sched, self.kv, max_len,
                             in_batch_prefix_cache=kvc.enable_prefix_cache and kvc.enable_in_batch_prefix_cache,
                             policy=SchedulingPolicy(sched, config.profile.max_global_ttft_ms), latency=latency,
                             lookahead=self.spec.lookahead if self.spec is not None else 0,
                             limits=prefill_limits(config, max_len))

        self.scheduler = make_scheduler(config.scheduler)
        self._worker = (ThreadPoolExecutor(1, thread_name_prefix="heterollm-step")
                        if config.scheduler.enable_schedule_overlap else None)
        """--enable_schedule_overlap: runs the executor's steps; None runs them inline."""
        self._in_flight: tuple[SchedulerOutput, Future, float] | None = None
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, tuple[_Parent, _Child]] = {}
        self.profiler: StepProfiler | None = None
        self._profiling = False
        self.warmup_shapes = warm_up(self) if config.fastdeploy.use_warmup else []
        """(prompt tokens, tokens generated) of the --use_warmup requests run before serving."""
        self.token_budget = None
        """--enable_profile_token_budget: the profiled tokens per step, the scheduler's budget."""
        if config.profile.enable_profile_token_budget:
            self.token_budget = profile_token_budget(self)
            self.scheduler = make_scheduler(config.scheduler.model_copy(
                update={"max_tokens_per_batch": self.token_budget}))
        self.profiler = StepProfiler() if config.profile.enable_profile_step_time else None
        if self.scheduler.latency is not None:
            if self.profiler is not None:
                self.profiler.model = self.scheduler.latency.model
            profile_step_time(self)

    def _structured_output_manager(self, config: HeterollmConfig) -> StructuredOutputManager | None:
        fd = config.fastdeploy
        if fd.guided_decoding_backend == "off":
            return None
        return StructuredOutputManager(self.tokenizer.hf, self.vocab_size, self.eos_token_ids,
                                       disable_any_whitespace=fd.guided_decoding_disable_any_whitespace)

    # -- requests --------------------------------------------------------------------------
    def compile_grammar(self, spec: StructuredOutputsParams) -> Future:
        """Start compiling a request's constraint (thread-safe, cached): front ends wait on it
        before admitting the request, so a grammar that does not compile is a 400 naming the field.
        The future's error is a StructuredOutputError."""
        if self.structured is None:
            raise RequestRejected(spec.field_name, "structured output is off on this engine "
                                  "(--guided_decoding_backend=off); start it with --guided_decoding_backend auto "
                                  "(or xgrammar)")
        return self.structured.compile(spec)

    def _grammar_states(self, params: SamplingParams, count: int) -> list[Any]:
        """One GrammarState per sequence (None without structured output); a constraint whose
        compile already failed is refused here."""
        spec = params.structured_outputs
        if spec is None:
            return [None] * count
        states = [GrammarState(self.compile_grammar(spec), spec) for _ in range(count)]
        if states[0].error is not None:
            raise RequestRejected(spec.field_name, states[0].error.reason)
        return states

    def tokenize_prompt(self, prompt: str | list[int] | dict[str, Any],
                        multimodal: bool = False) -> tuple[str | None, list[int]]:
        """(text, ids) of a prompt. A dict's `multi_modal_data` is the caller's to process
        (`multimodal=True`); a caller that cannot take images (embed, score, beam search) gets a
        RequestRejected naming the field instead of the images being dropped."""
        if isinstance(prompt, dict) and prompt.get("multi_modal_data") and not multimodal:
            raise RequestRejected("multi_modal_data", "images are taken by generate and chat only (not by embed, "
                                                      "score or beam search)")
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise RequestRejected("prompt", "a prompt dict needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise RequestRejected("prompt", f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return None, list(prompt)
        raise RequestRejected("prompt", "must be a string or a list of token ids")

    def add_request(self, prompt: str | list[int] | dict[str, Any], params: SamplingParams | None = None,
                    request_id: str | None = None, prompt_token_ids: list[int] | None = None,
                    priority: int = 0, ttft_slo_ms: int | None = None, pooling: PoolingParams | None = None,
                    mm_items: list[MultiModalItem] | None = None,
                    kv_transfer_params: dict[str, Any] | None = None) -> str:
        """Admit a request (raises RequestRejected naming the bad field; nothing is admitted then).

        `pooling`: an embedding or scoring request (heterollm.pooling): its prompt runs like any
        prompt, then it ends with RequestOutput.pooled instead of tokens (of `params` only
        truncate_prompt_tokens counts). A launch that cannot serve it, or that cannot generate when
        `pooling` is None, refuses it naming --task.

        `priority` (lower first) needs --priority_strategy=priority; `ttft_slo_ms` is the time to first
        token the request asks for: the deadline under --priority_strategy=deadline, and counted as
        missed (RequestMetrics.ttft_slo_missed) under every strategy when the first token is later.

        Images: a prompt dict's `multi_modal_data` ({"image": [...]}) and `mm_processor_kwargs`, one
        placeholder per image in the prompt (heterollm.multimodal); or `mm_items` already processed
        (with `prompt_token_ids` already expanded), as the API server sends them.

        `kv_transfer_params` (prefill/decode disaggregation, kv_cache/pd.py): {"do_remote_decode": true}
        on a PREFILL instance keeps the request's blocks when it ends and puts what a DECODE instance
        needs into its final RequestOutput.kv_transfer_params; that object, given to a DECODE
        instance, makes it pull the prompt's K/V instead of computing it."""
        self._check_scheduling_fields(priority, ttft_slo_ms)
        params, pooling = self._task_params(params, pooling)
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._parents:
            raise RequestRejected("request_id", f"request id {request_id!r} is already in use")
        if prompt_token_ids is not None:
            text, ids = (prompt if isinstance(prompt, str) else None), list(prompt_token_ids)
        else:
            text, ids = self.tokenize_prompt(prompt, multimodal=True)
        if mm_items is None and isinstance(prompt, dict) and (prompt.get("multi_modal_data") or self.multimodal.processor):
            ids, mm_items = self.multimodal.admit(ids, prompt.get("multi_modal_data"), prompt.get("mm_processor_kwargs"))
        if mm_items and params is not None and params.truncate_prompt_tokens is not None:
            raise RequestRejected("truncate_prompt_tokens", "cannot cut a prompt that carries images")
        try:
            params, ids = admit_params(params, ids, self._admission_limits())  # the request's own copy
            pd = self._pd_admit(kv_transfer_params, ids, params, pooling) if kv_transfer_params else None
        except RequestRejected:
            self._drop_claimed_reservation(kv_transfer_params)
            raise
        now = time.monotonic()
        parent = _Parent(request_id, text, ids, params, now)
        children = []
        grammars = self._grammar_states(params, params.num_sequences)
        for i in range(params.num_sequences):
            rid = request_id if params.num_sequences == 1 else f"{request_id}#{i}"
            req = Request(rid, ids, params, arrival_time=now, seed_offset=i, max_model_len=self.max_model_len,
                          priority=priority, ttft_slo_ms=ttft_slo_ms, grammar=grammars[i], pooling=pooling,
                          mm_items=mm_items or None)
            if pd is not None:
                pd.apply(req)
            children.append(_Child(req, IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens), i))
        added = []
        try:
            for child in children:
                self.scheduler.add(child.request)
                added.append(child)
            self._ask_plugins(request_id, ids, params)
            if pd is not None and pd.reservation is not None:
                self.scheduler.claim(pd.reservation, children[0].request)
        except BaseException:
            for child in added:
                self.scheduler.finish(child.request.request_id, "abort")
            if pd is not None and pd.reservation is not None:  # the prefill is over: nothing writes there now
                self.scheduler.cancel_reservation(pd.reservation)
            raise
        parent.children = children
        self._parents[request_id] = parent
        for child in children:
            self._children[child.request.request_id] = (parent, child)
        return request_id

    def _pd_admit(self, kv: Any, ids: list[int], params: SamplingParams,
                  pooling: PoolingParams | None) -> _PDAdmission:
        """Check a request's kv_transfer_params against this instance's role (RequestRejected naming
        the field) and say what it does to the request."""
        role = pd_role(self.config)
        if not isinstance(kv, dict):
            raise RequestRejected("kv_transfer_params", "must be an object")
        if pooling is not None or params.num_sequences != 1:
            raise RequestRejected("kv_transfer_params", "a disaggregated request generates one sequence (n = 1, "
                                  "best_of = 1, no pooling)")
        mode = self.config.pd.kv_cache_transfer_mode
        if kv.get("do_remote_decode"):
            if role not in ("PREFILL", "MIX"):
                raise RequestRejected("kv_transfer_params", f"do_remote_decode: this instance's role is {role}; "
                                      "a PREFILL instance (--instance_role PREFILL) prefills for a decode instance")
            if "reservation_id" in kv and (role != "PREFILL" or
                                           "kv_connectors.mooncake_transfer" not in self.selection.components):
                raise RequestRejected("kv_transfer_params", f"a decode instance's reservation: this instance's role is "
                                      f"{role}; a PREFILL instance (--instance_role PREFILL) writes into it")
            if role == "PREFILL" and ("reservation_id" in kv) != (mode == "PUSH"):
                theirs = "PUSH (it reserved blocks)" if "reservation_id" in kv else "PULL (no reservation)"
                raise RequestRejected("kv_transfer_params", f"this PREFILL instance runs --kv_cache_transfer_mode="
                                      f"{mode}, the decode instance {theirs}: start both with the same mode")
            if "reservation_id" not in kv:
                return _PDAdmission(hold=True)
            return _PDAdmission(push=self._push_target(kv, ids), push_reservation=str(kv["reservation_id"]))
        if not kv.get("do_remote_prefill"):
            if kv:
                raise RequestRejected("kv_transfer_params", "needs do_remote_decode or do_remote_prefill")
            return _PDAdmission()
        if role not in ("DECODE", "MIX") or "kv_connectors.mooncake_transfer" not in self.selection.components:
            raise RequestRejected("kv_transfer_params", f"do_remote_prefill: this instance's role is {role}; a DECODE "
                                  "instance (--instance_role DECODE) takes K/V from a prefill instance")
        if params.logprobs is not None or params.prompt_logprobs is not None:
            raise RequestRejected("logprobs", "a disaggregated request's first token was sampled by the prefill "
                                  "instance, which sends no logprobs: logprobs are not served with kv_transfer_params")
        if ("reservation_id" in kv) != (mode == "PUSH"):
            raise RequestRejected("kv_transfer_params", f"this DECODE instance runs --kv_cache_transfer_mode={mode}; "
                                  "these params are a " + ("PUSH" if "reservation_id" in kv else "PULL") +
                                  " prefill answer: start both instances with the same mode")
        if mode == "PUSH":
            return self._pushed(kv, ids)
        try:
            peers = peers_from(kv)
            remote_blocks = [int(b) for b in kv["remote_block_ids"]]
            first = int(kv["first_token_id"])
            remote_ids = [int(t) for t in kv["prompt_token_ids"]]
            block_size = int(kv["block_size"])
            expires_at = float(kv.get("expires_at", "inf"))
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestRejected("kv_transfer_params", f"not a prefill instance's answer: {exc}") from None
        if remote_ids != list(ids):
            raise RequestRejected("kv_transfer_params", "prompt_token_ids differ from this instance's tokenization of "
                                  "the prompt: the two instances must serve the same model and chat template")
        if block_size != self.config.kv_cache.block_size:
            raise RequestRejected("kv_transfer_params", f"block_size {block_size} differs from this instance's "
                                  f"--block_size={self.config.kv_cache.block_size}")
        if len(remote_blocks) < -(-len(ids) // block_size):
            raise RequestRejected("kv_transfer_params", "remote_block_ids do not cover the prompt")
        if not 0 <= first < self.vocab_size:
            raise RequestRejected("kv_transfer_params", f"first_token_id {first} is outside the vocabulary")
        return _PDAdmission(pull=(peers, remote_blocks, expires_at), first_token=first)

    def _push_target(self, kv: dict[str, Any], ids: list[int]) -> tuple[Any, list[int], int, float]:
        """PUSH, PREFILL: where the decode instance's reservation wants the prompt's blocks."""
        try:
            peers = peers_from(kv)
            blocks = [int(b) for b in kv["remote_block_ids"]]
            skip = int(kv["cached_blocks"])
            n = int(kv["num_prompt_tokens"])
            block_size = int(kv["block_size"])
            expires_at = float(kv["expires_at"])
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestRejected("kv_transfer_params", f"not a decode instance's reservation: {exc}") from None
        if block_size != self.config.kv_cache.block_size:
            raise RequestRejected("kv_transfer_params", f"block_size {block_size} differs from this instance's "
                                  f"--block_size={self.config.kv_cache.block_size}")
        if n != len(ids):
            raise RequestRejected("kv_transfer_params", f"the decode instance reserved blocks for {n} prompt tokens; "
                                  f"this instance's tokenization of the prompt has {len(ids)}: the two instances "
                                  "must serve the same model and chat template")
        if len(blocks) < -(-n // block_size) or not 0 <= skip <= (n - 1) // block_size:
            raise RequestRejected("kv_transfer_params", "remote_block_ids do not cover the prompt")
        if any(not 0 <= b < peer.shape[2] for b in blocks for peer in peers):
            raise RequestRejected("kv_transfer_params", "remote_block_ids name blocks outside the decode instance's cache")
        return peers, blocks, skip, expires_at

    def _pushed(self, kv: dict[str, Any], ids: list[int]) -> _PDAdmission:
        """PUSH, DECODE: the prefill instance's answer after writing into a reservation of this instance."""
        try:
            reservation = str(kv["reservation_id"])
            first = int(kv["first_token_id"])
            remote_ids = [int(t) for t in kv["prompt_token_ids"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise RequestRejected("kv_transfer_params", f"not a prefill instance's answer: {exc}") from None
        if remote_ids != list(ids):
            raise RequestRejected("kv_transfer_params", "prompt_token_ids differ from this instance's tokenization of "
                                  "the prompt: the two instances must serve the same model and chat template")
        held = self.scheduler.reserved.get(reservation)
        if held is not None and held[1] != list(ids):
            raise RequestRejected("kv_transfer_params", f"reservation {reservation!r} was made for another prompt "
                                  f"({len(held[1])} tokens; this one has {len(ids)})")
        if not 0 <= first < self.vocab_size:
            raise RequestRejected("kv_transfer_params", f"first_token_id {first} is outside the vocabulary")
        return _PDAdmission(reservation=reservation, first_token=first)

    def _drop_claimed_reservation(self, kv: Any) -> None:
        """A DECODE request that names a reservation (the prefill instance is done writing) was refused:
        its blocks are freed now, not at the reservation's expiry."""
        if isinstance(kv, dict) and kv.get("do_remote_prefill") and isinstance(kv.get("reservation_id"), str):
            self.scheduler.cancel_reservation(kv["reservation_id"])

    def reserve_kv(self, prompt_token_ids: list[int]) -> dict[str, Any]:
        """PD PUSH, on a DECODE instance: reserve blocks for a prompt whose K/V a prefill instance will
        write (kv_cache/pd.py); the answer is what that instance needs, as its request's
        kv_transfer_params. A reservation nobody claims is freed after HOLD_TIMEOUT_S. Under
        --kv_cache_transfer_mode=PULL nothing is reserved: the answer only says the mode. Raises
        RequestRejected (503) when the cache has no room now."""
        if pd_role(self.config) != "DECODE" or self._pd_ranks is None:
            raise RequestRejected("kv_transfer_params", f"reserve: this instance's role is {pd_role(self.config)}; a "
                                  "DECODE instance (--instance_role DECODE) reserves blocks for a prefill instance")
        if self.config.pd.kv_cache_transfer_mode != "PUSH":
            return {"kv_cache_transfer_mode": self.config.pd.kv_cache_transfer_mode}
        ids = [int(t) for t in prompt_token_ids]
        if not 0 < len(ids) < self.max_model_len:
            raise RequestRejected("prompt", f"the prompt has {len(ids)} tokens; this instance serves 1 to "
                                  f"{self.max_model_len - 1} (max_model_len {self.max_model_len})")
        rid = f"kvres-{uuid.uuid4().hex}"
        got = self.scheduler.reserve(rid, ids)
        if got is None:
            raise RequestRejected("kv_transfer_params", f"the KV cache has no room for {len(ids)} prompt tokens now "
                                  "(every block is in use); retry later", status=503)
        cached, table = got
        return {"do_remote_decode": True, "kv_cache_transfer_mode": "PUSH", "reservation_id": rid,
                "remote_engine_id": self.engine_id, "remote_ranks": self._pd_ranks, "remote_block_ids": table,
                "cached_blocks": cached, "num_prompt_tokens": len(ids), "block_size": self.config.kv_cache.block_size,
                "expires_at": time.time() + HOLD_TIMEOUT_S}

    def _pd_params(self, parent: _Parent) -> dict[str, Any] | None:
        """A finished do_remote_decode request's answer for the DECODE instance."""
        r = parent.children[0].request
        if parent.finished and r.pd_reservation and r.output_token_ids and r.finish_reason in ("stop", "length") \
                and r.request_id not in self.scheduler.transferring:
            return {"do_remote_prefill": True, "kv_cache_transfer_mode": "PUSH", "reservation_id": r.pd_reservation,
                    "remote_engine_id": self.engine_id, "prompt_token_ids": list(r.prompt_token_ids),
                    "first_token_id": r.output_token_ids[0], "block_size": self.config.kv_cache.block_size}
        if not (parent.finished and r.kv_hold and r.held_blocks and r.output_token_ids):
            return None
        held = self.scheduler.held.get(r.request_id, self.scheduler.clock())
        return {"do_remote_prefill": True, "remote_request_id": r.request_id, "remote_engine_id": self.engine_id,
                "remote_ranks": self._pd_ranks, "remote_block_ids": list(r.held_blocks),
                "prompt_token_ids": list(r.prompt_token_ids), "first_token_id": r.output_token_ids[0],
                "block_size": self.config.kv_cache.block_size,
                "expires_at": time.time() + held - self.scheduler.clock()}

    def release_kv(self, remote_request_id: str) -> bool:
        """Free the blocks this PREFILL instance kept for `remote_request_id` (after the DECODE instance
        pulled them), or this DECODE instance's reservation of that id (PUSH: a prefill that failed);
        False when it keeps none (released already, claimed, expired, or unknown)."""
        return self.scheduler.release_held(remote_request_id) or self.scheduler.cancel_reservation(remote_request_id)

    def _admission_limits(self) -> AdmissionLimits:
        return AdmissionLimits(self.vocab_size, self.max_model_len, frozenset(self.eos_token_ids),
                               lambda text: self.tokenizer.encode(text, add_special_tokens=False))

    def _ask_plugins(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestRejected with the first reason a plugin's `heterollm_on_request` gives."""
        reasons = self.plugins.hook.heterollm_on_request(request_id=request_id,
                                                         prompt_token_ids=list(prompt_token_ids), sampling=params)
        if reasons:
            raise RequestRejected("request", f"refused by a plugin: {reasons[0]}")

    def _finished(self, output: RequestOutput) -> None:
        """Tell the plugins a request ended (once per admitted request); their errors are logged."""
        try:
            self.plugins.hook.heterollm_on_request_finished(request_id=output.request_id, output=output)
        except Exception:
            logger.exception("a plugin's heterollm_on_request_finished failed for %s", output.request_id)

    def _task_params(self, params: SamplingParams | None,
                     pooling: PoolingParams | None) -> tuple[SamplingParams, PoolingParams | None]:
        """Generation: the params as given (RequestRejected when this launch cannot generate).
        Pooling: the launch's defaults filled in, and params for one greedy step that never samples."""
        if pooling is None:
            refusal = self.pooling.generation_refusal()
            if refusal is not None:
                raise RequestRejected("task", refusal)
            return params or SamplingParams(), None
        keep = params.truncate_prompt_tokens if params is not None else None
        return SamplingParams(max_tokens=1, temperature=0, truncate_prompt_tokens=keep), self.pooling.resolve(pooling)

    def _check_scheduling_fields(self, priority: int, ttft_slo_ms: int | None) -> None:
        if isinstance(priority, bool) or not isinstance(priority, int) or not -2**31 <= priority < 2**31:
            raise RequestRejected("priority", "must be an integer that fits in 32 bits")
        strategy = self.config.scheduler.priority_strategy
        if priority != 0 and strategy != "priority":
            raise RequestRejected("priority", f"a non-zero priority needs --priority_strategy=priority "
                                              f"(this engine schedules by {strategy})")
        if ttft_slo_ms is not None and (isinstance(ttft_slo_ms, bool) or not isinstance(ttft_slo_ms, int)
                                        or not 0 < ttft_slo_ms < 2**31):
            raise RequestRejected("ttft_slo_ms", "must be a positive integer number of milliseconds")

    def abort(self, request_id: str) -> None:
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return
        for child in parent.children:
            self.scheduler.finish(child.request.request_id, "abort")
            child.request.kv_abandoned = True  # a move under way ends unwatched (its blocks come back then)
            self._children.pop(child.request.request_id, None)
            if self.proposer is not None:
                self.proposer.finish(child.request.request_id)
        self._finished(self._output(parent))

    def unfinished_ids(self) -> list[str]:
        """The requests admitted and neither finished nor aborted, in admission order."""
        return list(self._parents)

    def is_unfinished(self, request_id: str) -> bool:
        """Whether `request_id` was admitted and has not finished or been aborted."""
        return request_id in self._parents

    def update_weights(self, update: WeightUpdate) -> dict[str, float]:
        """Replace the model's weights between steps (--dynamic_load_weight): a step in flight finishes
        on the old ones; running requests keep their KV cache and go on with the new weights; the
        prefix cache is emptied (its blocks were computed with the old ones)."""
        if not self.config.fastdeploy.dynamic_load_weight:
            raise RequestRejected("dynamic_load_weight", "reloading weights needs --dynamic_load_weight 1")
        if self._in_flight is not None:
            self._in_flight[1].result()  # the step ends first; its outputs are still processed as usual
        started = time.perf_counter()
        try:
            count = self.executor.update_weights(update)
        except NotImplementedError as exc:
            raise RequestRejected("dynamic_load_weight", str(exc)) from None
        except WeightUpdateError as exc:
            raise RequestRejected(exc.field, str(exc)) from None
        if self.kv.enable_prefix_cache:
            self.kv.reset_prefix_cache()
        seconds = time.perf_counter() - started
        logger.info("reloaded %d weight tensors in %.2fs; the prefix cache was emptied", count, seconds)
        return {"tensors": count, "seconds": seconds}

    def start_profile(self) -> None:
        """Start the online profiler on every rank (--enable_online_profile), between two steps, on
        the thread that runs the steps."""
        self._profile_call(True)

    def stop_profile(self) -> list[str]:
        """Stop it; every rank's trace file (in --profile_dir), to open in Perfetto."""
        return self._profile_call(False)

    def _profile_call(self, start: bool) -> Any:
        if not self.config.profile.enable_online_profile:
            raise RequestRejected("enable_online_profile", "online profiling needs --enable_online_profile "
                                                           "(and, optionally, --profile_dir and --profile_backend)")
        if start == self._profiling:
            raise RequestRejected("profile", "a profile is already being recorded; stop it first" if start else
                                  "no profile is being recorded; start one first")
        if self._in_flight is not None:
            self._in_flight[1].result()  # the step ends first; its outputs are still processed as usual
        call = self.executor.start_profile if start else self.executor.stop_profile
        try:
            # with schedule overlap the steps run on the step thread: profile that thread
            result = self._worker.submit(call).result() if self._worker is not None else call()
        except NotImplementedError as exc:
            raise RequestRejected("enable_online_profile", str(exc)) from None
        self._profiling = start
        if start:
            logger.info("online profile started (--profile_backend %s)", self.config.profile.profile_backend)
        else:
            logger.info("online profile written: %s", ", ".join(result) or "(handed to the capture tool)")
        return result

    def check_health(self) -> None:
        """Raise ExecutorDead when the executor's workers are gone (executors that have workers). Called
        by the serving loops while the engine is idle (about every 0.5 s): it also looks at the moves
        nobody waits for any more, so their blocks come back without waiting for traffic."""
        check = getattr(self.executor, "check_health", None)
        if check is not None:
            check()
        if self.scheduler.transferring and not self.has_unfinished():
            try:
                so = self.scheduler.schedule()  # nothing to run: a step that only polls the moves
                result, run_s = self._execute(so)
                self._process(so, result, self._update(so, result))
                self._after_step(so, result, 0.0, time.perf_counter(), run_s)
            except ExecutorDead:
                raise
            except Exception:  # the moves are looked at again at the next check
                logger.exception("polling the KV moves nobody waits for failed")

    def stats(self) -> dict[str, Any]:
        """The engine's gauges and counters, by name (what /metrics exports per replica; an engine-core
        process sends them to the API server)."""
        kv, spec = self.kv, self.spec_stats
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_usage": kv.usage, "kv_free_blocks": kv.num_free_blocks, "kv_total_blocks": kv.pool.num_blocks,
                "kv_reserved_bytes": self.kv_plan.kv_bytes, "kv_committed_bytes": self.kv_committed_bytes(),
                "prefix_queries": kv.queries, "prefix_hits": kv.hits, "prefix_cached_blocks": kv.pool.num_cached,
                **self._host_tier_stats(),
                "spec_acceptance_rate": spec.acceptance_rate or 0.0,
                "spec_mean_accepted_length": spec.mean_accepted_length or 0.0, "spec_num_drafts": spec.num_drafts,
                "spec_num_draft_tokens": spec.num_draft_tokens, "spec_num_accepted_tokens": spec.num_accepted_tokens,
                "spec_accepted_per_position": list(spec.accepted_per_position), "moe": self.expert_load}

    def _check_host_tier_memory(self, config: HeterollmConfig) -> None:
        """The host tier is host memory on every rank: refuse one larger than what the host has left
        (on a platform whose KV cache is committed lazily, as the CPU's, minus that reservation too)."""
        need = self.host_blocks * self.kv_plan.bytes_per_block
        avail = host_available_bytes()
        if self.selection.platform.idle_kv_budget_bytes is not None:
            avail -= self.kv_plan.kv_bytes
        if need > avail:
            raise ConfigError(f"{host_tier_flag(config)}: the host KV tier needs {mib(need)} ({self.host_blocks} blocks) "
                              f"of host memory; {mib(max(avail, 0))} is available beside the KV cache: lower it")

    def _open_kv_store(self, config: HeterollmConfig) -> StoreTier | None:
        """Connect to the KV cache store (before the weights load: an unreachable master fails fast)."""
        st = config.kv_cache_store
        if not st.enable_kvcache_store:
            return None
        client = open_store(config, STORE_SEGMENT_BYTES)
        logger.info("KV cache store: mooncake_master %s, metadata %s, %s; %d MiB of this host mounted",
                    st.store_master_server_address, st.store_metadata_server, st.store_protocol,
                    STORE_SEGMENT_BYTES >> 20)
        return StoreTier(client, key_prefix(config, self.source.hf_config), config.parallel.tp_size,
                         st.prefetch_batch_size, st.prefetch_timeout)

    def _size_store_fetches(self) -> None:
        """Now that a block's bytes are known: a fetch batch stays within the store client's buffer."""
        if self.kv_store is not None:
            self.kv_store.fit_batches(-(-self.kv_plan.bytes_per_block // max(1, self.config.parallel.tp_size)))

    def _host_tier_stats(self) -> dict[str, int]:
        host = getattr(self.kv, "host", None)
        return {"prefix_host_hits": self.kv.host_hits, "host_tier_blocks": host.num_slots if host else 0,
                "host_tier_cached_blocks": host.num_used if host else 0, "host_tier_saved": host.saved if host else 0,
                "host_tier_loaded": host.loaded if host else 0,
                "prefix_store_hits": getattr(self.kv, "store_hits", 0),
                "kv_pull_blocks": self.kv_pull_blocks, "kv_pull_seconds": self.kv_pull_seconds,
                "kv_push_blocks": self.kv_push_blocks, "kv_push_seconds": self.kv_push_seconds,
                "kv_reservations": len(self.scheduler.reserved), "kv_moving": len(self.scheduler.transferring),
                "store_put_blocks": self.kv_store.put if self.kv_store else 0,
                "store_fetched_blocks": self.kv_store.fetched if self.kv_store else 0}

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # -- the step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and run one step; returns the outputs it produced. With schedule overlap, the
        step is left running and the outputs are those of the step before it."""
        if self.scheduler.deferred:
            failed = self._fail_grammars()
            if failed:
                return failed
        if self.scheduler.transferring:
            expired = self._expire_moves()
            if expired:
                return expired
        if self._worker is not None:
            return self._step_overlapped()
        t0 = time.perf_counter()
        so = self.scheduler.schedule()
        if not so.requests and not self._moves_only(so):
            return self._stuck()
        self._note_moves(so)
        self._fill_grammar_bitmask(so)
        t1 = time.perf_counter()
        result, run_s = self._execute(so)
        t2 = time.perf_counter()
        changed = self._update(so, result)
        outputs = self._process(so, result, changed)
        self._propose(result, changed)
        self._after_step(so, result, t1 - t0, t2, run_s)
        return outputs

    def _execute(self, so: SchedulerOutput) -> tuple[RunnerOutput, float]:
        t = time.perf_counter()
        result = self.executor.execute(so)
        moves = pd_moves(so)
        if moves is not None and moves.pushes:  # a push is timed from the end of its forward
            done = time.monotonic() - result.timings.get("kv_push", 0.0)
            for move in moves.pushes:
                if move.request_id in self._moves:
                    kind, blocks, _, expires_at = self._moves[move.request_id]
                    self._moves[move.request_id] = (kind, blocks, done, expires_at)
        return result, time.perf_counter() - t

    def _step_overlapped(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        so = self.scheduler.schedule()  # while the previous step runs
        schedule_s = time.perf_counter() - t0
        previous, self._in_flight = self._in_flight, None
        runs = bool(so.requests) or self._moves_only(so)
        self._note_moves(so)
        if previous is None and not runs:
            return self._stuck()
        changed = None
        if previous is not None:
            prev_so, future, prev_schedule_s = previous
            try:
                result, run_s = future.result()
            except BaseException:
                for request_id in self.scheduler.unstarted(so):
                    self._moves.pop(request_id, None)
                raise
            changed = self._update(prev_so, result)
        self.scheduler.resolve()
        if runs:
            self._fill_grammar_bitmask(so)
            self._in_flight = (so, self._worker.submit(self._execute, so), schedule_s)
        if previous is None:
            return []
        t2 = time.perf_counter()
        outputs = self._process(prev_so, result, changed)
        self._after_step(prev_so, result, prev_schedule_s, t2, run_s)
        return outputs

    def _note_moves(self, so: SchedulerOutput) -> None:
        moves = pd_moves(so)
        if moves is not None:
            now = time.monotonic()
            for kind, started in (("pull", moves.pulls), ("push", moves.pushes)):
                for move in started:
                    self._moves[move.request_id] = (kind, len(move.local_blocks), now, move.expires_at)

    def _expire_moves(self) -> list[RequestOutput]:
        """PD: a move still under way when the peer's hold on its blocks ran out can bring nothing
        usable any more (a peer that never answered: Mooncake's handshake has no timeout of its own).
        Its request ends now with the reason; its blocks come back when the move ends."""
        now, touched = time.time(), set()
        for request_id, r in self.scheduler.transferring.items():
            move = self._moves.get(request_id)
            if r.kv_abandoned or move is None or now <= move[3]:
                continue
            r.kv_abandoned = True
            if request_id not in self._children:
                continue
            parent, child = self._children[request_id]
            why = (f"{'pushing' if move[0] == 'push' else 'pulling'} the prompt's KV failed: the transfer did not "
                   f"end before the peer's hold on the blocks ran out (held {HOLD_TIMEOUT_S:.0f} s)")
            logger.error("request %s: %s", request_id, why)
            r.error, r.finish_reason, r.finished_time = why, "error", time.monotonic()
            child.final_text = child.detok.text
            self.scheduler.finish(request_id, "error")
            touched.add(parent.request_id)
        return self._outputs(touched)

    def _moves_only(self, so: SchedulerOutput) -> bool:
        """PD: a step with no request still runs while K/V moves: it starts the pulls just scheduled,
        or polls the moves under way (every rank; briefly paced, as nothing else is computed)."""
        if so.kv_transfers:
            return True
        if self.scheduler.moving() or (self.scheduler.transferring and self.scheduler.waiting):
            time.sleep(MOVE_POLL_S)  # (a waiting request may need the blocks an abandoned move still holds)
            return True
        return False

    def _update(self, so: SchedulerOutput, result: RunnerOutput) -> list[tuple[Request, list[int]]]:
        """The scheduler takes the step's tokens; each sequence's grammar advances by them."""
        changed = self.scheduler.update(so, result)
        if result.expert_load is not None:
            self.expert_load = result.expert_load
        if self.spec is not None:
            self._spec_step = self.spec_stats.observe(so, result)
        if self.structured is not None:
            for request, tokens in changed:
                if request.grammar is not None:
                    self._advance_grammar(request, tokens)
        return changed

    def _advance_grammar(self, request: Request, tokens: list[int]) -> None:
        for token in tokens:
            if request.grammar.terminated:
                return
            if not request.grammar.accept(token):  # only when the mask left nothing (e.g. min_tokens vs EOS)
                logger.error("request %s: token %d breaks its %s constraint; stopping it", request.request_id,
                             token, request.grammar.spec.kind)
                request.finish_reason = "abort"
                return

    def _propose(self, result: RunnerOutput, changed: list[tuple[Request, list[int]]]) -> None:
        """Speculative decoding: drafts for the next step of each request that took tokens and goes on
        (a draft model's came with the step; suffix / n-gram propose here). A request under a
        grammar decodes without drafts (its mask would have to follow each draft)."""
        if self.spec is None:
            return
        k = self.spec.num_speculative_tokens
        worker = dict(zip(result.request_ids, result.spec_token_ids)) if result.spec_token_ids is not None else None
        for request, tokens in changed:
            if not tokens or request.finished or request.status is not RequestStatus.RUNNING or request.grammar:
                continue
            if worker is not None:
                request.spec_token_ids = worker.get(request.request_id, [])
            elif self.spec.tree:
                request.spec_token_ids, request.spec_parents = self.proposer.propose_tree(
                    request.request_id, request.all_token_ids, request.num_prompt_tokens, k)
            elif self.proposer is not None:
                request.spec_token_ids = self.proposer.propose(request.request_id, request.all_token_ids,
                                                               request.num_prompt_tokens, k)

    def _fill_grammar_bitmask(self, so: SchedulerOutput) -> None:
        """Give the step the grammar bitmask of each request that samples under one (after `resolve`:
        every token a grammar has to see is known by then)."""
        if self.structured is None:
            return
        states = []
        for item in so.requests:
            r = self.scheduler.requests.get(item.request_id)
            if item.sample and r is not None and r.grammar is not None:
                item.grammar_row = len(states)
                states.append(r.grammar)
        if states:
            so.grammar_bitmask = self.structured.fill_bitmask(states)

    def _fail_grammars(self) -> list[RequestOutput]:
        """Requests whose grammar failed to compile after admission end (aborted, the reason logged)."""
        failed = [r for r in self.scheduler.deferred if r.grammar.error is not None]
        for r in failed:
            logger.error("request %s: %s", r.request_id, r.grammar.error)
            self.scheduler.finish(r.request_id, "abort")
        return self._outputs({self._children[r.request_id][0].request_id for r in failed})

    def _stuck(self) -> list[RequestOutput]:
        """Nothing could be scheduled: a waiting request that no free cache can hold is aborted; while
        only grammars are compiling, wait (briefly) for one."""
        if self.scheduler.deferred and not self.scheduler.waiting and not self.scheduler.running:
            wait([r.grammar.future for r in self.scheduler.deferred], timeout=0.05, return_when=FIRST_COMPLETED)
            return []
        if self.scheduler.waiting and not self.scheduler.running and self.scheduler.reserved:
            time.sleep(0.05)  # PD PUSH: reserved blocks come back when claimed (and run) or expired
            self.scheduler.schedule_expiry()
            return []
        if self.scheduler.waiting and not self.scheduler.running:
            stuck = self.scheduler.waiting[0]
            logger.error("request %s cannot be scheduled (KV cache too small for it); aborting it",
                         stuck.request_id)
            self.scheduler.finish(stuck.request_id, "abort")
            return self._outputs({self._children[stuck.request_id][0].request_id})
        return []

    def _after_step(self, so: SchedulerOutput, result: RunnerOutput, schedule_s: float, t_output: float,
                    run_s: float) -> None:
        if self.scheduler.latency is not None and so.requests:  # a step that only moved K/V models nothing
            self.scheduler.latency.model.observe(
                [(len(r.new_token_ids), r.num_computed_tokens) for r in so.requests], run_s)
            host = so.kv_transfers.get("host") if so.kv_transfers is not None else None
            if host is not None and host.load:
                self.scheduler.latency.observe_copy(
                    len(host.load), result.timings.get("kv_load", result.timings.get("kv_transfer", 0.0)))
        if self.kv_events is not None:
            self.kv_events.publish(self.kv.take_events())
        if self.profiler is not None and so.requests:
            self.profiler.record(len(so.requests), so.num_tokens, schedule_s, result.timings,
                                 time.perf_counter() - t_output, self._spec_step if self.spec is not None else None)

    def _count_move(self, request_id: str, why: str | None, now: float) -> None:
        """The KV transfer counters of a move that ended (its blocks, once they arrived, and the time
        from the step that started it to the step that saw it end)."""
        kind, blocks, started, _ = self._moves.pop(request_id, (None, 0, now, 0.0))
        if why is not None or kind is None:
            return
        if kind == "pull":
            self.kv_pull_blocks += blocks
            self.kv_pull_seconds += now - started
        else:
            self.kv_push_blocks += blocks
            self.kv_push_seconds += now - started

    def _process(self, so: SchedulerOutput, result: RunnerOutput,
                 changed: list[tuple[Request, list[int]]]) -> list[RequestOutput]:
        """Turn a step's new tokens (from the scheduler's update) into text, stop checks, outputs."""
        touched: set[str] = set()
        now = time.monotonic()
        for request_id, why in (result.kv_done or {}).items():
            self._count_move(request_id, why, now)
            if request_id not in self._children:
                continue
            parent, child = self._children[request_id]
            r = child.request
            if why is not None:
                logger.error("request %s: %s", request_id, why)
                verb = "pushing" if r.pd_reservation else "pulling"
                r.error, r.finish_reason, r.finished_time = f"{verb} the prompt's KV failed: {why}", "error", now
                child.final_text = child.detok.text
                self.scheduler.finish(request_id, "error")
                touched.add(parent.request_id)
            elif r.status is RequestStatus.FINISHED:  # a PREFILL instance's answer waited for its push
                touched.add(parent.request_id)
        for request, tokens in changed:
            if request.request_id not in self._children or request.error:  # aborted, or its move failed
                continue
            parent, child = self._children[request.request_id]
            if request.pooled is not None and child.final_text is None:  # a pooling request is done
                request.finish_reason, child.final_text = "stop", ""
            if request.first_token_time is None:
                request.first_token_time = now
                if request.deadline is not None and now > request.deadline:
                    self.scheduler.note_deadline_missed(request, now, "first token")
            for n, token in enumerate(tokens, 1):
                self._process_token(child, token, len(tokens) - n)
                if child.final_text is not None:
                    if n < len(tokens):  # speculative decoding took tokens past the stop: drop them
                        del request.output_token_ids[n - len(tokens):]
                        del request.logprobs[len(request.output_token_ids):]
                    break
            if child.final_text is not None:
                request.finished_time = now
                self.scheduler.finish(request.request_id, request.finish_reason or "stop")
            if request.request_id in self.scheduler.transferring:  # PUSH: answered once the K/V is in place
                continue
            touched.add(parent.request_id)
        for item in so.requests:
            if item.want_prompt_logprobs and item.request_id in self._children:
                touched.add(self._children[item.request_id][0].request_id)
        return self._outputs(touched)

    def _process_token(self, child: _Child, token: int, ahead: int = 0) -> None:
        """`ahead`: tokens of the same update after this one (speculative decoding takes several at once)."""
        r, p = child.request, child.request.params
        delta = child.detok.add(token)
        n_out = len(r.output_token_ids) - ahead
        can_stop = n_out >= p.min_tokens
        if can_stop and token in p.stop_token_ids:
            r.finish_reason, r.stop_reason = "stop", token
        elif can_stop and not p.ignore_eos and token in self.eos_token_ids:
            r.finish_reason = "stop"
        elif can_stop and p.stop and delta:
            text = child.detok.text
            longest = max(len(s) for s in p.stop)
            start = max(0, len(text) - len(delta) - longest + 1)
            hits = [(text.find(s, start), s) for s in p.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                idx, stop = min(hits)
                r.finish_reason, r.stop_reason = "stop", stop
                child.final_text = text[: idx + len(stop)] if p.include_stop_str_in_output else text[:idx]
                return
        if r.finish_reason is None and (n_out >= (p.max_tokens or 1 << 30) or r.num_tokens - ahead >= self.max_model_len):
            r.finish_reason = "length"
        if r.finish_reason is None and r.grammar is not None and r.grammar.terminated:
            r.finish_reason = "stop"  # the grammar ended (its stop token was taken, even with ignore_eos)
        if r.finish_reason is not None:
            child.detok.flush()
            child.final_text = child.detok.text

    def _outputs(self, parent_ids: set[str]) -> list[RequestOutput]:
        outs = []
        for pid in sorted(parent_ids, key=lambda i: self._parents[i].arrival_time if i in self._parents else 0):
            parent = self._parents.get(pid)
            if parent is None:
                continue
            out = self._output(parent)
            outs.append(out)
            if parent.finished:
                del self._parents[pid]
                for child in parent.children:
                    self._children.pop(child.request.request_id, None)
                    if self.proposer is not None:
                        self.proposer.finish(child.request.request_id)
                self._finished(out)
        return outs

    def _output(self, parent: _Parent) -> RequestOutput:
        completions = []
        for child in parent.children:
            r = child.request
            if child.final_text is not None:
                text = child.final_text
                visible = len(text)
            else:
                text = child.detok.text
                hold = max((len(s) for s in r.params.stop), default=1) - 1
                visible = max(child.emitted_chars, len(text) - hold)
            delta = text[child.emitted_chars:visible]
            child.emitted_chars = visible
            delta_ids = r.output_token_ids[child.emitted_tokens:]
            child.emitted_tokens = len(r.output_token_ids)
            completions.append(CompletionOutput(
                index=child.index, text=text[:visible], token_ids=list(r.output_token_ids),
                logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
                cumulative_logprob=sum(lp.logprob for lp in r.logprobs) if r.logprobs else None,
                finish_reason=r.finish_reason if r.finished or child.final_text is not None else None,
                stop_reason=r.stop_reason, delta_text=delta, delta_token_ids=delta_ids))
        if parent.params.needs_cumulative_logprob:
            completions = best_of(completions, parent.params.n, parent.finished)
        first = parent.children[0].request
        finished_times = [c.request.finished_time for c in parent.children if c.request.finished_time]
        metrics = RequestMetrics(
            arrival_time=parent.arrival_time,
            first_token_time=min((c.request.first_token_time for c in parent.children
                                  if c.request.first_token_time), default=None),
            finished_time=max(finished_times) if parent.finished and finished_times else None,
            num_prompt_tokens=len(parent.prompt_token_ids),
            num_generated_tokens=sum(len(c.request.output_token_ids) for c in parent.children),
            num_preemptions=sum(c.request.num_preemptions for c in parent.children),
            num_cached_tokens=first.num_cached_tokens or 0,
            ttft_slo_missed=any(c.request.ttft_slo_missed for c in parent.children),
            spec_num_draft_tokens=sum(c.request.num_draft_tokens for c in parent.children),
            spec_num_accepted_tokens=sum(c.request.num_accepted_tokens for c in parent.children))
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, completions,
                             parent.finished, metrics,
                             first.prompt_logprobs if parent.params.prompt_logprobs is not None else None,
                             first.pooled,
                             kv_transfer_params=self._pd_params(parent) if first.kv_hold or first.pd_reservation else None,
                             error=first.error)

    def write_unfinished_profile(self) -> None:
        """A profile still recording is written, not lost (at shutdown). Call it on the thread that
        runs the steps: torch's profiler crashes the process (SIGSEGV) when another thread stops it."""
        if self._profiling:
            try:
                self.stop_profile()
            except Exception as exc:  # the executor may be what failed
                logger.warning("could not write the online profile at shutdown: %s", exc)

    def shutdown(self) -> None:
        self.write_unfinished_profile()
        if self._worker is not None:
            if self._in_flight is not None:
                self._in_flight[1].exception()  # let the running step end before the executor goes
                self._in_flight = None
            self._worker.shutdown()
        if self.profiler is not None:
            self.profiler.flush()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.structured is not None:
            self.structured.shutdown()
        self.executor.shutdown()
        if getattr(self, "kv_store", None) is not None:  # its mounted memory leaves the store
            close_store(self.config)
            self.kv_store = None
        self._release_reservation()
