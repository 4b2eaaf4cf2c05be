"""The engine for servers: the synchronous LLMEngine stepped by one background thread, fed and
drained through thread-safe queues, with results streamed to asyncio callers.

Only the engine thread touches the LLMEngine. Callers submit `add`/`abort` commands; the thread
applies them between steps, so admission errors (RequestRejected) come back to the caller that
caused them and a request is never half-admitted. A step that raises fails the requests in it
with EngineError and the loop goes on: one bad step must not leave a dead engine.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from heterollm.engine.llm_engine import LLMEngine
from heterollm.engine.outputs import RequestOutput
from heterollm.multimodal import MultiModalItem
from heterollm.scheduler.request import RequestRejected
from heterollm.interfaces import ExecutorDead
from heterollm.pooling import PoolingParams
from heterollm.sampling import SamplingParams, StructuredOutputError, StructuredOutputsParams

logger = logging.getLogger("heterollm.engine")


class EngineError(RuntimeError):
    """The engine failed while running a request (HTTP 500); the engine itself keeps serving."""


class Outstanding:
    """Per admitted request, the tokens it still costs (prompt + tokens left to generate): how a
    server with several replicas picks one. Thread-safe: the caller's loop admits, the engine side
    updates and drops."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cost: dict[str, int] = {}
        """Tokens at admission (prompt + max_tokens x n)."""
        self._left: dict[str, int] = {}

    def admit(self, request_id: str, prompt: str | list[int], prompt_token_ids: list[int] | None,
              params: SamplingParams) -> None:
        cost = len(prompt_token_ids or prompt) + (params.max_tokens or 0) * params.num_sequences
        with self._lock:
            self._cost[request_id] = self._left[request_id] = cost

    def progress(self, output: RequestOutput) -> None:
        """The tokens an output carries are no longer outstanding; a finished request, nothing is."""
        request_id = output.request_id
        if output.finished:
            self.drop(request_id)
            return
        with self._lock:
            if request_id in self._left:
                self._left[request_id] = self._cost[request_id] - sum(len(c.token_ids) for c in output.outputs)

    def drop(self, request_id: str) -> None:
        with self._lock:
            self._cost.pop(request_id, None)
            self._left.pop(request_id, None)

    def total(self) -> int:
        with self._lock:
            return sum(self._left.values())

    def __len__(self) -> int:
        """Requests admitted and not done."""
        with self._lock:
            return len(self._left)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finished: Callable[[RequestOutput], None] | None = None,
                 on_aborted: Callable[[str], None] | None = None,
                 on_dead: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.on_finished = on_finished
        """Called on the engine thread with each request's final output (metrics hook)."""
        self.on_aborted = on_aborted
        """Called on the engine thread with the id of each request aborted before it finished."""
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heterollm-engine", daemon=True)
        self.on_dead = on_dead
        """Called once, on the engine thread, when the executor's workers are gone (ExecutorDead)."""
        self.dead: str | None = None
        self._submit_lock = threading.Lock()
        self._closed = False
        """Set under _submit_lock before the loop's final drain: no command can slip in after it."""
        self._outstanding = Outstanding()
        self.steps = 0
        self.step_errors = 0

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread (once; later calls do nothing)."""
        if self._thread.ident is None:
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
        self.engine.shutdown()

    # -- the caller's side -----------------------------------------------------------------
    async def add(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                  prompt_token_ids: list[int] | None = None, first_output_timeout: float | None = None,
                  priority: int = 0, ttft_slo_ms: int | None = None,
                  pooling: PoolingParams | None = None,
                  mm_items: list[MultiModalItem] | None = None,
                  kv_transfer_params: dict[str, Any] | None = None) -> RequestStream:
        """Admit the request; its outputs then come from the returned stream. `mm_items`: its images,
        preprocessed, with `prompt_token_ids` already expanded; `kv_transfer_params`: prefill/decode
        disaggregation (both as LLMEngine.add_request takes them).

        Raises RequestRejected when the engine refuses the request (nothing is admitted then).
        The stream raises RequestRejected (status 503) when `first_output_timeout` seconds pass
        before the first output. Closing the stream early (a client that went away) aborts the
        request and frees its blocks."""
        if not self.alive:
            raise self._not_running()
        if params.structured_outputs is not None:
            await self._compiled(params.structured_outputs)
        self._outstanding.admit(request_id, prompt, prompt_token_ids, params)
        loop = asyncio.get_running_loop()
        admitted = loop.create_future()
        stream = _Stream(loop, asyncio.Queue())
        try:
            self._submit(("add", (prompt, params, request_id, prompt_token_ids, priority, ttft_slo_ms, pooling,
                                  mm_items, kv_transfer_params), admitted, stream))
        except EngineError:
            self._unload(request_id)
            raise
        try:
            await admitted
        except asyncio.CancelledError:  # the caller went away while the request was being admitted
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream.queue, first_output_timeout)

    async def _compiled(self, spec: StructuredOutputsParams) -> None:
        """Wait, off the engine thread, for the request's grammar to compile: one that does not is a
        RequestRejected naming its field, before anything is admitted."""
        try:
            await asyncio.wrap_future(self.engine.compile_grammar(spec))
        except StructuredOutputError as exc:
            raise RequestRejected(spec.field_name, str(exc.named(spec.field_name))) from None

    async def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str,
                       prompt_token_ids: list[int] | None = None) -> AsyncIterator[RequestOutput]:
        """add() and iterate in one: yields the request's outputs until the finished one."""
        stream = await self.add(prompt, params, request_id, prompt_token_ids)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        try:
            self._submit(("abort", request_id, None, None))
        except EngineError:  # stopped: nothing runs any more
            self._unload(request_id)

    def _not_running(self) -> EngineError:
        return EngineError(f"the engine is not running: {self.dead}" if self.dead else "the engine is shutting down")

    def _submit(self, command: tuple) -> None:
        """Queue a command for the engine thread, or raise EngineError once it has stopped taking them."""
        with self._submit_lock:
            if self._closed:
                raise self._not_running()
            self._commands.put(command)
        self._wake.set()

    def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread (between steps) and wait for its result; for tests
        and admin reads that need a consistent view."""
        done = threading.Event()
        box: dict[str, Any] = {}
        self._submit(("call", (fn, box, done), None, None))
        done.wait()
        if "error" in box:
            raise box["error"]
        return box["value"]

    async def utility(self, method: str, *args: Any) -> Any:
        """Run one of the engine's admin methods (update_weights, start_profile, stop_profile) between
        two steps; its RequestRejected comes back as raised."""
        return await asyncio.to_thread(self.call, lambda engine: getattr(engine, method)(*args))

    def stats(self) -> dict[str, Any]:
        """The engine's gauges and counters (LLMEngine.stats), read now."""
        return self.engine.stats()

    # -- the engine thread -----------------------------------------------------------------
    def _die(self, why: str) -> None:
        self.dead = why
        logger.error("the engine cannot go on (%s): failing every request", why)
        for request_id in list(self._streams):
            self._deliver(request_id, EngineError(f"the engine failed: {why}"))
        self._stop.set()
        if self.on_dead is not None:
            self.on_dead(why)

    @property
    def load(self) -> int:
        """Outstanding tokens (prompt + tokens still to generate) of the requests admitted and not
        finished: how a server with several replicas picks one."""
        return self._outstanding.total()

    def _unload(self, request_id: str) -> None:
        self._outstanding.drop(request_id)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            self._unload(request_id)
            return
        if isinstance(item, BaseException) or item.finished:
            del self._streams[request_id]
            self._unload(request_id)
        else:
            self._outstanding.progress(item)
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the caller's loop is closed: nobody is listening any more
            self._abort_now(request_id)

    def _abort_now(self, request_id: str) -> None:
        """On the engine thread: forget the request's stream and load, abort it if it still runs."""
        self._streams.pop(request_id, None)
        self._unload(request_id)
        if self.engine.is_unfinished(request_id):
            self.engine.abort(request_id)
            if self.on_aborted is not None:
                self.on_aborted(request_id)

    def _apply(self, kind: str, payload: Any, admitted: Any, stream: Any) -> None:
        if kind == "add":
            prompt, params, request_id, ids, priority, ttft_slo_ms, pooling, mm_items, kv_params = payload
            if self._closed:  # the final drain: nothing will run it
                self._unload(request_id)
                stream.loop.call_soon_threadsafe(_settle, admitted, self._not_running())
                return
            try:
                self.engine.add_request(prompt, params, request_id=request_id, prompt_token_ids=ids,
                                        priority=priority, ttft_slo_ms=ttft_slo_ms, pooling=pooling,
                                        mm_items=mm_items, kv_transfer_params=kv_params)
            except Exception as exc:  # RequestRejected and anything a bad prompt provokes
                if not isinstance(exc, RequestRejected):
                    logger.exception("admitting request %s failed", request_id)
                    exc = EngineError(f"admitting the request failed: {exc}")
                self._unload(request_id)
                stream.loop.call_soon_threadsafe(_settle, admitted, exc)
                return
            self._streams[request_id] = stream
            stream.loop.call_soon_threadsafe(_settle, admitted, None)
        elif kind == "abort":
            self._abort_now(payload)
        elif kind == "call":
            fn, box, done = payload
            try:
                box["value"] = fn(self.engine)
            except Exception as exc:
                box["error"] = exc
            done.set()

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            self._apply(*cmd)

    def _run(self) -> None:
        interval = self.engine.config.server.health_check_interval_ms / 1000
        while not self._stop.is_set():
            self._wake.clear()
            self._drain()
            try:
                if not self.engine.has_unfinished():
                    self._wake.wait(min(0.5, interval))
                    self.engine.check_health()
                    continue
                outputs = self.engine.step()
                self.steps += 1
            except ExecutorDead as exc:
                self._die(str(exc))
                break
            except Exception as exc:
                self.step_errors += 1
                logger.exception("engine step failed; failing the requests in flight")
                failed = list(self._streams)
                for request_id in failed:
                    self.engine.abort(request_id)
                # blocks registered when the failed step was scheduled (in-batch sharing) hold no K/V
                self.engine.kv.reset_prefix_cache()
                for request_id in failed:
                    self._deliver(request_id, EngineError(f"the engine failed on this batch: {exc}"))
                continue
            for out in outputs:
                report_finished(self.on_finished, out)
                self._deliver(out.request_id, out)
        # shutting down: whoever still waits learns why
        with self._submit_lock:
            self._closed = True
        self._drain()
        for request_id in list(self._streams):
            self._deliver(request_id, EngineError("the engine shut down"))
        # here, not in shutdown(): the server's shutdown runs on another thread, and torch's profiler
        # crashes the process when a thread other than the one that started it stops it
        self.engine.write_unfinished_profile()


class RequestStream:
    """The outputs of one admitted request, in order, ending with the finished one."""

    def __init__(self, owner: AsyncEngine, request_id: str, q: asyncio.Queue,
                 first_output_timeout: float | None) -> None:
        self.owner, self.request_id, self._queue = owner, request_id, q
        self._timeout = first_output_timeout
        self.finished = False

    def close(self) -> None:
        """Abort the request unless it already finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self.owner.abort(self.request_id)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        first = True
        try:
            while not self.finished:
                if first and self._timeout is not None:
                    try:
                        item = await asyncio.wait_for(self._queue.get(), self._timeout)
                    except asyncio.TimeoutError:
                        raise RequestRejected("request", f"the request waited more than max_waiting_time="
                                                         f"{self._timeout:g}s to start; retry later",
                                              status=503) from None
                else:
                    item = await self._queue.get()
                first = False
                if isinstance(item, BaseException):
                    self.finished = True  # the engine already dropped it
                    raise item
                if item.finished:
                    self.finished = True
                yield item
        finally:
            self.close()


def report_finished(hook: Callable[[RequestOutput], None] | None, output: RequestOutput) -> None:
    """Give a finished request's output to the server's hook (metrics); a hook that fails is logged."""
    if output.finished and hook is not None:
        try:
            hook(output)
        except Exception:
            logger.exception("on_finished hook failed")


def _settle(future: asyncio.Future, exc: BaseException | None) -> None:
    if future.done():
        return
    if exc is None:
        future.set_result(None)
    else:
        future.set_exception(exc)

