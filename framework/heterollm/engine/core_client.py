"""The API server's side of the engine-core processes (`heterollm serve`).

EngineCoreClient starts one engine-core process (core_process.core_main), binds its two sockets and
offers what AsyncEngine offers an in-process server: `add` (admission errors come back to the caller),
`abort`, streams of RequestOutput, `utility` for admin calls, `stats` for /metrics, `load` for
picking a replica. One receiver thread per core decodes its messages and hands each output to the
asyncio loop that waits for it. A core that dies (killed, or its workers gone) fails every request
in flight with EngineError, turns `alive` false and calls `on_dead` once.

EngineFrontend is what the API server needs of the engine without loading it: the tokenizer and chat
template, the checkpoint's generation defaults, the pooling setup and plugins, plus the
max_model_len the core reports once its KV cache is sized.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing as mp
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from heterollm.config import ConfigError, HeterollmConfig
from heterollm.config.checks import engine_replicas
from heterollm.engine import core_ipc as ipc
from heterollm.engine.async_engine import (EngineError, Outstanding, RequestStream, _settle, _Stream,
                                           report_finished)
from heterollm.engine.core_process import CoreAddresses, core_main
from heterollm.engine.outputs import RequestOutput
from heterollm.multimodal import MultiModalItem
from heterollm.multimodal.processor import MultiModalInputs
from heterollm.pooling import PoolingParams
from heterollm.sampling import SamplingParams
from heterollm.scheduler.request import RequestRejected

logger = logging.getLogger("heterollm.engine")

POLL_MS = 100
"""How often the receiver thread looks at the core process when no message comes."""


class EngineFrontend:
    """The engine as the API server process sees it (no weights, no KV cache)."""

    def __init__(self, config: HeterollmConfig, max_model_len: int | None = None) -> None:
        """`max_model_len`: None until the cores report theirs (EngineCoreClient.wait_ready)."""
        from heterollm.model_executor.loader import resolve_model
        from heterollm.plugins import make_plugin_manager
        from heterollm.pooling.task import build_setup
        from heterollm.tokenizer import load_tokenizer

        self.config = config
        self.source = resolve_model(config.model.model, config.fastdeploy.revision)
        self.tokenizer = load_tokenizer(self.source.folder, self.source.gguf_file, config.fastdeploy.tokenizer,
                                        self.source.eos_token_ids, config.fastdeploy.chat_template)
        self.eos_token_ids = self.tokenizer.eos_token_ids
        self.vocab_size = self.source.hf_config.vocab_size
        self.max_model_len = max_model_len
        self.plugins = make_plugin_manager()
        self.pooling = build_setup(config, self.source.hf_config, self.source.folder, self.tokenizer.hf,
                                   (self.source.architectures or [""])[0])
        self.multimodal = MultiModalInputs.for_launch(config, self.source, self.tokenizer.hf)
        """Images -> placeholder tokens and pixel patches, done here (the API server process) so the
        core receives them preprocessed; refuses images on a text-only model."""


def _addresses(config: HeterollmConfig, dp_rank: int) -> CoreAddresses:
    """ipc sockets in a private temporary folder; with --engine_worker_queue_port set, TCP on the
    loopback at that port + 2 x dp_rank (to the core) and the next one (from it)."""
    default = type(config.fastdeploy).model_fields["engine_worker_queue_port"].default
    port = config.fastdeploy.engine_worker_queue_port
    if port != default:
        base = port + 2 * dp_rank
        return CoreAddresses(f"tcp://127.0.0.1:{base}", f"tcp://127.0.0.1:{base + 1}")
    folder = tempfile.mkdtemp(prefix="heterollm-core-")
    return CoreAddresses(f"ipc://{folder}/{dp_rank}-in", f"ipc://{folder}/{dp_rank}-out")


class EngineCoreClient:
    """One engine-core process and the API server's handle on it."""

    def __init__(self, config: HeterollmConfig, dp_rank: int = 0) -> None:
        """Start the process (its engine loads in the background; `wait_ready` waits for it)."""
        self.config, self.dp_rank = config, dp_rank
        timeout_ms = config.server.rpc_channel_timeout_ms
        self.rpc_timeout = timeout_ms / 1000 if timeout_ms > 0 else None
        """--rpc_channel_timeout_ms: how long an admission or admin call waits for the core (None: forever)."""
        self.on_finished: Callable[[RequestOutput], None] | None = None
        self.on_aborted: Callable[[str], None] | None = None
        self.on_dead: Callable[[str], None] | None = None
        self.frontend: EngineFrontend | None = None
        self.dead: str | None = None
        self._enc, self._dec = ipc.encoder(), ipc.from_core_decoder()
        self._receiver_outputs = ipc.OutputReceiver()
        """Rebuilds whole outputs from the core's deltas (receiver thread only, but for `forget`)."""
        self._ctx = zmq.Context()
        self.addresses = _addresses(config, dp_rank)
        self._to_core = self._ctx.socket(zmq.PUSH)
        self._from_core = self._ctx.socket(zmq.PULL)
        for sock, address in ((self._to_core, self.addresses.to_core), (self._from_core, self.addresses.from_core)):
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(address)
            except zmq.ZMQError as exc:
                self._close_sockets()
                raise ConfigError(f"--engine_worker_queue_port: cannot listen on {address} for the engine core "
                                  f"(dp rank {dp_rank}): {exc}") from None
        self._send_lock = threading.Lock()
        self._streams: dict[str, _Stream] = {}
        self._admitting: dict[str, tuple[asyncio.Future, _Stream]] = {}
        self._calls: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future]] = {}
        self._call_ids = itertools.count()
        self._outstanding = Outstanding()
        self._lock = threading.Lock()
        """Guards the tables above: the asyncio loop writes them, the receiver thread reads and pops."""
        self._stats: dict[str, Any] | None = None
        self._closed = False
        self._receiver: threading.Thread | None = None
        self.process = mp.get_context("spawn").Process(
            target=core_main, name=f"heterollm-core-{dp_rank}", daemon=False,
            args=(config, dp_rank, self.addresses, os.getpid(), logging.getLogger().getEffectiveLevel()))
        self.process.start()
        self._started = time.monotonic()
        logger.info("engine core (dp rank %d) starting in process %d", dp_rank, self.process.pid)

    # -- start-up and shutdown ---------------------------------------------------------------
    def wait_ready(self, frontend: EngineFrontend | None = None) -> None:
        """Block until the engine has loaded; raises ConfigError (a launch the flags make impossible)
        or RuntimeError (it failed while loading, or the process died). `frontend`: the API server's
        view, shared by the replicas (built here when not given); its max_model_len becomes the
        smallest any core reports."""
        if frontend is None:
            frontend = EngineFrontend(self.config)
        while True:
            if self._from_core.poll(POLL_MS):
                msg = self._dec.decode(self._from_core.recv())
                if isinstance(msg, ipc.Ready):
                    break
                if isinstance(msg, ipc.StartFailed):
                    self.process.join(10)
                    if msg.config_error:
                        raise ConfigError(msg.message)
                    raise RuntimeError(f"the engine core (dp rank {self.dp_rank}) failed to start: {msg.message}")
            elif not self.process.is_alive():
                raise RuntimeError(f"the engine core (dp rank {self.dp_rank}) exited with status "
                                   f"{self.process.exitcode} while loading")
        known = frontend.max_model_len
        frontend.max_model_len = msg.max_model_len if known is None else min(known, msg.max_model_len)
        self.frontend = frontend
        logger.info("engine core (dp rank %d) ready in %.1fs: process %d, %d KV blocks, max_model_len %d",
                    self.dp_rank, time.monotonic() - self._started, msg.pid, msg.num_blocks, msg.max_model_len)
        self._receiver = threading.Thread(target=self._receive, name=f"heterollm-core-client-{self.dp_rank}",
                                          daemon=True)
        self._receiver.start()

    def start(self) -> None:
        """Nothing to do: the core runs since `wait_ready` (AsyncEngine's lifecycle, for the server)."""

    @property
    def alive(self) -> bool:
        return self.dead is None and not self._closed and self.process.is_alive()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Ask the core to stop, wait for it (killed past `timeout`), fail whatever still waits."""
        if self._closed:
            return
        if self.process.is_alive():
            try:
                self._send(ipc.Shutdown())
            except zmq.ZMQError:
                pass
            self.process.join(timeout)
            if self.process.is_alive():
                logger.error("engine core (dp rank %d) did not stop in %.0fs; killing it", self.dp_rank, timeout)
                self.process.kill()
                self.process.join(5)
        self._closed = True
        if self._receiver is not None:
            self._receiver.join(2 * POLL_MS / 1000 + 1)
        self._fail_all(EngineError("the engine shut down"))
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._to_core, self._from_core):
            sock.close(linger=0)
        self._ctx.term()
        for address in (self.addresses.to_core, self.addresses.from_core):
            if address.startswith("ipc://"):
                try:
                    os.unlink(address[len("ipc://"):])
                except OSError:
                    pass
        folder = os.path.dirname(self.addresses.to_core[len("ipc://"):])
        if self.addresses.to_core.startswith("ipc://"):
            try:
                os.rmdir(folder)
            except OSError:
                pass

    # -- the caller's side -------------------------------------------------------------------
    def _send(self, msg: Any) -> None:
        data = self._enc.encode(msg)
        with self._send_lock:
            self._to_core.send(data)

    def _not_running(self) -> EngineError:
        return EngineError(f"the engine is not running: {self.dead}" if self.dead else "the engine is shutting down")

    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                  prompt_token_ids: list[int] | None = None, first_output_timeout: float | None = None,
                  priority: int = 0, ttft_slo_ms: int | None = None,
                  pooling: PoolingParams | None = None,
                  mm_items: list[MultiModalItem] | None = None,
                  kv_transfer_params: dict[str, Any] | None = None) -> RequestStream:
        """As AsyncEngine.add: admit the request in the core; its outputs come from the stream."""
        if not self.alive:
            raise self._not_running()
        msg = ipc.Add(request_id, prompt, prompt_token_ids, ipc.params_to_wire(params), priority, ttft_slo_ms,
                      msgspec.to_builtins(pooling) if pooling is not None else None,
                      [item.to_wire() for item in mm_items] if mm_items else None, kv_transfer_params)
        loop = asyncio.get_running_loop()
        admitted = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        self._outstanding.admit(request_id, prompt, prompt_token_ids, params)
        with self._lock:
            self._admitting[request_id] = (admitted, stream)
        try:
            self._send(msg)
            await asyncio.wait_for(admitted, self.rpc_timeout)
        except asyncio.TimeoutError:
            self.abort(request_id)
            raise EngineError(f"the engine core did not admit the request within --rpc_channel_timeout_ms="
                              f"{self.config.server.rpc_channel_timeout_ms}") from None
        except asyncio.CancelledError:  # the caller went away while the request was being admitted
            self.abort(request_id)
            raise
        except BaseException:
            self._unload(request_id)
            raise
        return RequestStream(self, request_id, stream.queue, first_output_timeout)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._admitting.pop(request_id, None)
            self._streams.pop(request_id, None)
        self._outstanding.drop(request_id)
        self._receiver_outputs.forget(request_id)
        if self.alive:
            try:
                self._send(ipc.Abort(request_id))
            except zmq.ZMQError:
                pass

    async def utility(self, method: str, *args: Any) -> Any:
        """Run an admin method of the engine in the core, between two steps (core_process.UTILITIES)."""
        if not self.alive:
            raise self._not_running()
        call_id = next(self._call_ids)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            self._calls[call_id] = (loop, future)
        self._send(ipc.Utility(call_id, method, [msgspec.to_builtins(a) for a in args]))
        try:
            return await asyncio.wait_for(future, self.rpc_timeout)
        except asyncio.TimeoutError:
            raise EngineError(f"the engine core did not answer {method} within --rpc_channel_timeout_ms="
                              f"{self.config.server.rpc_channel_timeout_ms}") from None
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def stats(self) -> dict[str, Any]:
        """The engine's gauges and counters as the core last sent them (at most STATS_INTERVAL_S old
        while it steps; current once it is idle)."""
        if self._stats is None:
            return _EMPTY_STATS
        return self._stats

    @property
    def load(self) -> int:
        """Outstanding tokens of the requests in this core (Outstanding)."""
        return self._outstanding.total()

    def _unload(self, request_id: str) -> None:
        self._outstanding.drop(request_id)

    # -- the receiver thread -----------------------------------------------------------------
    def _receive(self) -> None:
        while not self._closed:
            try:
                ready = self._from_core.poll(POLL_MS)
                if ready:
                    self._handle(self._dec.decode(self._from_core.recv()))
                    continue
            except zmq.ZMQError:
                if self._closed:
                    return
                raise
            if not self.process.is_alive() and not self._closed:
                self._die(f"the engine core process (dp rank {self.dp_rank}, pid {self.process.pid}) exited with "
                          f"status {self.process.exitcode}")
                return

    def _handle(self, msg: Any) -> None:
        if isinstance(msg, ipc.Outputs):
            if msg.stats is not None:
                self._stats = msg.stats
            for data in msg.outputs:
                with self._lock:
                    listening = data["request_id"] in self._streams
                if not listening:  # aborted: its last outputs were already on their way
                    self._unload(data["request_id"])
                    continue
                out = self._receiver_outputs.decode(data)
                report_finished(self.on_finished, out)
                self._deliver(out.request_id, out)
            for request_id in msg.aborted:
                if self.on_aborted is not None:
                    self.on_aborted(request_id)
        elif isinstance(msg, ipc.Admitted):
            with self._lock:
                entry = self._admitting.pop(msg.request_id, None)
                if entry is not None and msg.error is None:
                    self._streams[msg.request_id] = entry[1]
            if entry is None:  # aborted while it was being admitted
                return
            if msg.error is not None:
                self._unload(msg.request_id)
            entry[1].loop.call_soon_threadsafe(_settle, entry[0], _error(msg.error))
        elif isinstance(msg, ipc.StepFailed):
            for request_id in msg.request_ids:
                self._receiver_outputs.forget(request_id)
                self._deliver(request_id, EngineError(msg.message))
        elif isinstance(msg, ipc.UtilityResult):
            with self._lock:
                entry = self._calls.get(msg.call_id)
            if entry is not None:
                entry[0].call_soon_threadsafe(_resolve, entry[1], msg.value, _error(msg.error))
        elif isinstance(msg, ipc.Dead):
            self._die(msg.why)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        final = isinstance(item, BaseException) or item.finished
        with self._lock:
            stream = self._streams.pop(request_id, None) if final else self._streams.get(request_id)
        if stream is None or final:
            self._unload(request_id)
        else:
            self._outstanding.progress(item)
        if stream is None:
            return
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self.abort(request_id)

    def _fail_all(self, error: EngineError) -> None:
        with self._lock:
            admitting, self._admitting = self._admitting, {}
            calls, self._calls = self._calls, {}
            waiting = list(self._streams)
        for future, stream in admitting.values():
            stream.loop.call_soon_threadsafe(_settle, future, error)
        for loop, future in calls.values():
            loop.call_soon_threadsafe(_resolve, future, None, error)
        for request_id in waiting:
            self._deliver(request_id, error)

    def _die(self, why: str) -> None:
        if self.dead is not None:
            return
        self.dead = why
        logger.error("the engine cannot go on (%s): failing every request", why)
        self._fail_all(EngineError(f"the engine failed: {why}"))
        if self.on_dead is not None:
            self.on_dead(why)


_EMPTY_STATS: dict[str, Any] = {
    "running": 0, "waiting": 0, "kv_usage": 0.0, "kv_free_blocks": 0, "kv_total_blocks": 0, "kv_reserved_bytes": 0,
    "kv_committed_bytes": 0, "prefix_queries": 0, "prefix_hits": 0, "prefix_cached_blocks": 0,
    "prefix_host_hits": 0, "host_tier_blocks": 0, "host_tier_cached_blocks": 0, "host_tier_saved": 0,
    "host_tier_loaded": 0, "prefix_store_hits": 0, "store_put_blocks": 0, "store_fetched_blocks": 0,
    "kv_pull_blocks": 0, "kv_pull_seconds": 0.0, "kv_push_blocks": 0, "kv_push_seconds": 0.0, "kv_reservations": 0,
    "kv_moving": 0,
    "spec_acceptance_rate": 0.0, "spec_mean_accepted_length": 0.0, "spec_num_drafts": 0, "spec_num_draft_tokens": 0,
    "spec_num_accepted_tokens": 0, "spec_accepted_per_position": [], "moe": None}
"""What /metrics shows for a core before its first report."""


def _error(rejection: ipc.Rejection | None) -> BaseException | None:
    if rejection is None:
        return None
    if rejection.engine_error:
        return EngineError(rejection.message)
    return RequestRejected(rejection.field or "request", rejection.message, rejection.status)


def _resolve(future: asyncio.Future, value: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


def start_engine_cores(config: HeterollmConfig) -> list[EngineCoreClient]:
    """The --dp_size engine cores, loading side by side; if one fails to start, every one is stopped
    and its error raised."""
    clients: list[EngineCoreClient] = []
    try:
        for rank in range(engine_replicas(config)):
            clients.append(EngineCoreClient(config, rank))
        frontend = EngineFrontend(config)  # the tokenizer and chat template load while the cores do
        for client in clients:
            client.wait_ready(frontend)
    except BaseException:
        for client in clients:
            client.shutdown(timeout=10)
        raise
    return clients
