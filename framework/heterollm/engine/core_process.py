"""The engine-core process of `heterollm serve`: one LLMEngine, stepped in a loop that does no HTTP
work (schedule -> execute -> sample -> output), fed and drained over pyzmq (core_ipc's messages).

`core_main` is the process's entry point. It ignores SIGINT and SIGTERM (the API server owns the
shutdown and sends Shutdown once its requests have drained) and exits by itself when the API server
process is gone. A step that raises fails the requests in it (StepFailed) and the loop goes on; an
executor whose workers died (ExecutorDead) ends the process with status 1 after a Dead message.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from multiprocessing import util as mp_util
from typing import Any, Callable

import zmq

from heterollm.config import ConfigError, HeterollmConfig
from heterollm.config.checks import engine_replicas
from heterollm.engine import core_ipc as ipc
from heterollm.engine.llm_engine import LLMEngine
from heterollm.interfaces import ExecutorDead
from heterollm.model_executor.weight_update import WeightUpdate
from heterollm.multimodal import MultiModalItem
from heterollm.sampling import StructuredOutputError
from heterollm.scheduler.request import RequestRejected

logger = logging.getLogger("heterollm.engine")

UTILITIES: dict[str, Callable[..., Any]] = {
    "update_weights": lambda engine, update: engine.update_weights(WeightUpdate(**update)),
    "start_profile": lambda engine: engine.start_profile(),
    "stop_profile": lambda engine: engine.stop_profile(),
    "release_kv": lambda engine, remote_request_id: engine.release_kv(remote_request_id),
    "reserve_kv": lambda engine, prompt_token_ids: engine.reserve_kv(prompt_token_ids),
}
"""The admin methods the API server may call (Utility messages), by name."""

SEND_LINGER_MS = 5000
"""How long the last messages (Dead, the final outputs) may take to reach the API server at exit."""


@dataclass(frozen=True)
class CoreAddresses:
    """The two sockets of one engine core, bound by the API server: it pushes to `to_core` and pulls
    from `from_core`."""

    to_core: str
    from_core: str


def build_engine(config: HeterollmConfig, dp_rank: int) -> LLMEngine:
    """Load the replica, with this process's torch threads sized for `--dp_size` replicas sharing the
    host's cores (a compiled step is specialized on the thread count, so `--enable_graph` sizes them
    first; otherwise loading uses every core). No core is kept for the API server: it is a process of
    its own now, and mostly waits on sockets. Measured on 2 cores with this repo's client at C=16,
    128 in / 64 out: 350.6 output tok/s with 2 threads here, 225.8 with 1 (the decode forward goes
    from 40 ms to 22 ms; a preempted pool thread costs less than the idle core)."""
    from heterollm.plugins import resolve

    platform = resolve(config).platform
    dp = engine_replicas(config)
    if config.execution.enable_graph:
        platform.configure_threads(dp)
        return LLMEngine(config, dp_rank=dp_rank)
    engine = LLMEngine(config, dp_rank=dp_rank)
    platform.configure_threads(dp)
    return engine


def core_main(config: HeterollmConfig, dp_rank: int, addresses: CoreAddresses, parent_pid: int,
              log_level: int) -> None:
    """The process's entry point (multiprocessing spawn target)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s %(name)s [core {dp_rank}]: %(message)s")
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    inbox.connect(addresses.to_core)
    outbox = ctx.socket(zmq.PUSH)
    outbox.setsockopt(zmq.LINGER, SEND_LINGER_MS)
    outbox.connect(addresses.from_core)
    enc = ipc.encoder()
    code = 0
    try:
        engine = build_engine(config, dp_rank)
    except BaseException as exc:  # the API server reports it; a launch error stays one line there
        from heterollm.plugins import LaunchError

        config_error = isinstance(exc, (ConfigError, LaunchError))
        if not config_error:
            logger.exception("the engine failed to start")
        outbox.send(enc.encode(ipc.StartFailed(str(exc) or type(exc).__name__, config_error)))
        code = 2 if config_error else 1
    else:
        outbox.send(enc.encode(ipc.Ready(os.getpid(), engine.max_model_len, engine.num_blocks)))
        code = EngineCore(engine, inbox, outbox, parent_pid).run()
    inbox.close(linger=0)
    outbox.close()
    ctx.term()
    logging.shutdown()
    mp_util._exit_function()  # multiprocessing's own finalizers (a tqdm lock's semaphore), as a normal exit runs them
    os._exit(code)  # engine threads (grammar compiles, the step thread) must not hold the exit


class EngineCore:
    """The loop of one engine-core process."""

    def __init__(self, engine: LLMEngine, inbox: zmq.Socket, outbox: zmq.Socket, parent_pid: int) -> None:
        self.engine, self.inbox, self.outbox, self.parent_pid = engine, inbox, outbox, parent_pid
        self.enc, self.dec = ipc.encoder(), ipc.to_core_decoder()
        self.compiling: dict[str, tuple[Future, ipc.Add]] = {}
        """Requests waiting for their grammar to compile before admission, in arrival order."""
        self.aborted: list[str] = []
        self.sender = ipc.OutputSender()
        self._stats_sent = 0.0
        self._stats_stale = False
        """An admin call changed the engine while idle (release_kv frees blocks): send the gauges again."""
        self._idle_interval = min(0.5, engine.config.server.health_check_interval_ms / 1000)

    def _send(self, msg: Any) -> None:
        self.outbox.send(self.enc.encode(msg))

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> int:
        """Until Shutdown, a dead executor (1) or the API server's exit; returns the exit status."""
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        was_busy = True  # the first idle pass sends the gauges at start
        try:
            while True:
                busy = self.engine.has_unfinished()
                if not busy and (was_busy or self.aborted or self._stats_stale):  # the gauges at rest, the last aborts
                    self._send(ipc.Outputs([], self._take_aborted(), self.engine.stats()))
                    was_busy = self._stats_stale = False
                timeout = 0 if busy else (10 if self.compiling else self._idle_interval * 1000)
                while poller.poll(timeout):
                    msg = self.dec.decode(self.inbox.recv())
                    if isinstance(msg, ipc.Shutdown):
                        return 0
                    self._handle(msg)
                    timeout = 0
                self._admit_compiled()
                if os.getppid() != self.parent_pid:  # checked busy too: its outputs would fill the socket
                    logger.error("the API server process is gone; the engine core exits")
                    return 1
                if not self.engine.has_unfinished():
                    self.engine.check_health()
                    continue
                was_busy = True
                self._step()
        except ExecutorDead as exc:
            logger.error("the engine cannot go on (%s)", exc)
            self._send(ipc.Dead(str(exc)))
            return 1
        finally:
            self.engine.shutdown()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except ExecutorDead:
            raise
        except Exception as exc:
            logger.exception("engine step failed; failing the requests in flight")
            failed = self.engine.unfinished_ids()
            for request_id in failed:
                self.engine.abort(request_id)
                self.sender.forget(request_id)
            # blocks registered when the failed step was scheduled (in-batch sharing) hold no K/V
            self.engine.kv.reset_prefix_cache()
            self._send(ipc.StepFailed(failed, f"the engine failed on this batch: {exc}"))
            return
        now = time.monotonic()
        stats = None
        if now - self._stats_sent >= ipc.STATS_INTERVAL_S:
            stats, self._stats_sent = self.engine.stats(), now
        self._send(ipc.Outputs([self.sender.encode(o) for o in outputs], self._take_aborted(), stats))

    def _take_aborted(self) -> list[str]:
        taken, self.aborted = self.aborted, []
        return taken

    # -- messages ----------------------------------------------------------------------------
    def _handle(self, msg: Any) -> None:
        if isinstance(msg, ipc.Add):
            self._add(msg)
        elif isinstance(msg, ipc.Abort):
            self._abort(msg.request_id)
        elif isinstance(msg, ipc.Utility):
            self._utility(msg)

    def _add(self, msg: ipc.Add) -> None:
        try:
            params = ipc.params_from_wire(msg.params)
            spec = params.structured_outputs
            if spec is not None:  # admitted once it compiles (a grammar that does not is refused)
                self.compiling[msg.request_id] = (self.engine.compile_grammar(spec), msg)
                return
        except Exception as exc:
            self._send(ipc.Admitted(msg.request_id, ipc.Rejection.of(exc)))
            return
        self._admit(msg, params)

    def _admit_compiled(self) -> None:
        for request_id, (future, msg) in list(self.compiling.items()):
            if not future.done():
                continue
            del self.compiling[request_id]
            params = ipc.params_from_wire(msg.params)
            error = future.exception()
            if isinstance(error, StructuredOutputError):
                spec = params.structured_outputs
                rejected = RequestRejected(spec.field_name, str(error.named(spec.field_name)))
                self._send(ipc.Admitted(request_id, ipc.Rejection.of(rejected)))
            else:
                self._admit(msg, params)

    def _admit(self, msg: ipc.Add, params: Any) -> None:
        try:
            items = [MultiModalItem.from_wire(d) for d in msg.mm_items] if msg.mm_items else None
            self.engine.add_request(msg.prompt, params, request_id=msg.request_id,
                                    prompt_token_ids=msg.prompt_token_ids, priority=msg.priority,
                                    ttft_slo_ms=msg.ttft_slo_ms, pooling=ipc.pooling_from_wire(msg.pooling),
                                    mm_items=items, kv_transfer_params=msg.kv_transfer_params)
        except Exception as exc:  # RequestRejected, and anything a bad prompt provokes
            if not isinstance(exc, RequestRejected):
                logger.exception("admitting request %s failed", msg.request_id)
                exc = RuntimeError(f"admitting the request failed: {exc}")
            self._send(ipc.Admitted(msg.request_id, ipc.Rejection.of(exc)))
            return
        self._send(ipc.Admitted(msg.request_id))

    def _abort(self, request_id: str) -> None:
        self.compiling.pop(request_id, None)
        self.sender.forget(request_id)
        if self.engine.is_unfinished(request_id):
            self.engine.abort(request_id)
            self.aborted.append(request_id)

    def _utility(self, msg: ipc.Utility) -> None:
        call = UTILITIES.get(msg.method)
        try:
            if call is None:
                raise RequestRejected("method", f"the engine core has no admin method {msg.method!r}")
            value = call(self.engine, *msg.args)
        except ExecutorDead:
            raise
        except Exception as exc:
            self._send(ipc.UtilityResult(msg.call_id, error=ipc.Rejection.of(exc)))
            return
        self._stats_stale = True
        self._send(ipc.UtilityResult(msg.call_id, value=value))
