"""The messages between the API server process and an engine-core process (`heterollm serve`):
msgspec Structs over two pyzmq PUSH/PULL sockets, msgpack-encoded.

API server -> core: Add, Abort, Utility, Shutdown.  Core -> API server: Ready or StartFailed once,
then Admitted (one per Add), Outputs (one per step, with every request's output of that step),
StepFailed, UtilityResult and, last, Dead.

The engine's own dataclasses (SamplingParams, RequestOutput, ...) travel as msgpack maps of their
fields; `*_from_wire` rebuilds them on the other side, so neither side needs pickle.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Union

import msgspec
import torch

from heterollm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from heterollm.interfaces import TokenLogprobs
from heterollm.pooling import PoolingParams
from heterollm.sampling import SamplingParams
from heterollm.scheduler.request import RequestRejected


# -- API server -> engine core ---------------------------------------------------------------
class Add(msgspec.Struct, tag=True):
    request_id: str
    prompt: str | list[int]
    prompt_token_ids: list[int] | None
    params: dict[str, Any]
    priority: int = 0
    ttft_slo_ms: int | None = None
    pooling: dict[str, Any] | None = None
    mm_items: list[dict[str, Any]] | None = None
    """The prompt's images, preprocessed (MultiModalItem.to_wire: pixels as raw float32 bytes)."""
    kv_transfer_params: dict[str, Any] | None = None
    """Prefill/decode disaggregation: LLMEngine.add_request's, as the request gave it."""


class Abort(msgspec.Struct, tag=True):
    request_id: str


class Utility(msgspec.Struct, tag=True):
    """Run one of the engine's admin methods (core_process.UTILITIES) between two steps."""

    call_id: int
    method: str
    args: list[Any] = []


class Shutdown(msgspec.Struct, tag=True):
    pass


ToCore = Union[Add, Abort, Utility, Shutdown]


# -- engine core -> API server ---------------------------------------------------------------
class Ready(msgspec.Struct, tag=True):
    """The engine is loaded: what the API server needs of it that only loading tells."""

    pid: int
    max_model_len: int
    num_blocks: int


class StartFailed(msgspec.Struct, tag=True):
    message: str
    config_error: bool
    """A launch the flags make impossible (the CLI exits 2), rather than a failure while loading."""


class Rejection(msgspec.Struct):
    field: str | None
    message: str
    status: int
    engine_error: bool = False
    """The engine failed (HTTP 500) rather than refused the request (RequestRejected)."""

    @classmethod
    def of(cls, exc: BaseException) -> Rejection:
        if isinstance(exc, RequestRejected):
            return cls(exc.field, str(exc), exc.status)
        return cls(None, str(exc), 500, engine_error=True)


class Admitted(msgspec.Struct, tag=True):
    request_id: str
    error: Rejection | None = None


class Outputs(msgspec.Struct, tag=True):
    outputs: list[dict[str, Any]]
    aborted: list[str] = []
    """Requests the core aborted on the API server's word while they were still running."""
    stats: dict[str, Any] | None = None
    """The engine's gauges and counters (LLMEngine.stats), sent at most every STATS_INTERVAL_S."""


class StepFailed(msgspec.Struct, tag=True):
    """A step raised: the requests in it failed, the engine goes on."""

    request_ids: list[str]
    message: str


class UtilityResult(msgspec.Struct, tag=True):
    call_id: int
    value: Any = None
    error: Rejection | None = None


class Dead(msgspec.Struct, tag=True):
    """The engine cannot go on (its workers are gone); the core process exits after this."""

    why: str


FromCore = Union[Ready, StartFailed, Admitted, Outputs, StepFailed, UtilityResult, Dead]

STATS_INTERVAL_S = 0.1


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):  # RequestOutput.pooled: CPU fp32 by contract
        return obj.detach().to(torch.float32).cpu().tolist()
    raise NotImplementedError(f"cannot send {type(obj).__name__} to or from the engine core")


def encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def to_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToCore)


def from_core_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromCore)


def _init_fields(cls: type, data: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {k: v for k, v in data.items() if k in names}


def params_to_wire(params: SamplingParams) -> dict[str, Any]:
    """The fields a caller sets (those the engine fills in at admission stay behind)."""
    return msgspec.to_builtins(params, enc_hook=_enc_hook)


def params_from_wire(data: dict[str, Any]) -> SamplingParams:
    return SamplingParams(**_init_fields(SamplingParams, data))


def pooling_from_wire(data: dict[str, Any] | None) -> PoolingParams | None:
    if data is None:
        return None
    fields = _init_fields(PoolingParams, data)
    if fields.get("score_token_ids") is not None:
        fields["score_token_ids"] = tuple(fields["score_token_ids"])
    return PoolingParams(**fields)


def output_to_wire(out: RequestOutput) -> dict[str, Any]:
    """The whole output (OutputSender sends less while a request runs)."""
    return msgspec.to_builtins(out, enc_hook=_enc_hook)


class OutputSender:
    """The core's side of the outputs: while a request runs, each of its outputs carries only the
    logprobs added since the previous one (`logprobs_start`: the position of the first carried) and
    its prompt logprobs once; a finished output is whole. Without this, a stream asking for logprobs
    would re-send (and the API server rebuild) every earlier position at every step: ~11 ms per
    output of 1,000 tokens with top-5 logprobs, against 0.03 ms without logprobs."""

    def __init__(self) -> None:
        self._sent: dict[str, dict[int, int]] = {}
        """Per running request: per completion index, the logprobs already sent."""

    def encode(self, out: RequestOutput) -> dict[str, Any]:
        if out.finished:
            self._sent.pop(out.request_id, None)
            return output_to_wire(out)
        first = out.request_id not in self._sent
        sent = self._sent.setdefault(out.request_id, {})
        completions = []
        for c in out.outputs:
            start = sent.get(c.index, 0)
            if c.logprobs is not None:
                sent[c.index] = len(c.logprobs)
                c = dataclasses.replace(c, logprobs=c.logprobs[start:])
            completions.append((c, start))
        lean = dataclasses.replace(out, outputs=[c for c, _ in completions],
                                   prompt_logprobs=out.prompt_logprobs if first else None)
        data = output_to_wire(lean)
        for wire, (_, start) in zip(data["outputs"], completions):
            wire["logprobs_start"] = start
        data["prompt_logprobs_sent"] = not first and out.prompt_logprobs is not None
        return data

    def forget(self, request_id: str) -> None:
        """The request ended without a finished output (aborted, or its step failed)."""
        self._sent.pop(request_id, None)


class OutputReceiver:
    """The API server's side: rebuilds each whole RequestOutput from OutputSender's messages."""

    def __init__(self) -> None:
        self._logprobs: dict[str, dict[int, list[TokenLogprobs]]] = {}
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None] | None] = {}

    def decode(self, data: dict[str, Any]) -> RequestOutput:
        out = output_from_wire(data)
        request_id = out.request_id
        if out.finished:
            self.forget(request_id)
            return out
        held = self._logprobs.get(request_id)
        if held is None:
            if any(wire.get("logprobs_start", 0) for wire in data["outputs"]):
                return out  # forgotten (aborted) while this output was on its way: nobody reads it
            held = self._logprobs[request_id] = {}
        for wire, c in zip(data["outputs"], out.outputs):
            if c.logprobs is None:
                continue
            have = held.setdefault(c.index, [])
            del have[wire.get("logprobs_start", 0):]  # (equal lengths: both sides count per index)
            have.extend(c.logprobs)
            c.logprobs = list(have)
        if data.get("prompt_logprobs_sent"):
            out.prompt_logprobs = self._prompt_logprobs.get(request_id)
        elif out.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = out.prompt_logprobs
        return out

    def forget(self, request_id: str) -> None:
        self._logprobs.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)


def _logprobs(items: list[dict[str, Any] | None] | None) -> list[TokenLogprobs | None] | None:
    if items is None:
        return None
    return [None if t is None else TokenLogprobs(t["token_id"], t["logprob"], t["rank"],
                                                 [(int(i), float(lp)) for i, lp in t["top"]]) for t in items]


def output_from_wire(data: dict[str, Any]) -> RequestOutput:
    completions = []
    for c in data["outputs"]:
        c = dict(c)
        c["logprobs"] = _logprobs(c.get("logprobs"))
        completions.append(CompletionOutput(**_init_fields(CompletionOutput, c)))
    pooled = data.get("pooled")
    fields = _init_fields(RequestOutput, data)  # every field the engine set (kv_transfer_params, error, ...)
    fields.update(outputs=completions, metrics=RequestMetrics(**_init_fields(RequestMetrics, data["metrics"])),
                  prompt_logprobs=_logprobs(data.get("prompt_logprobs")),
                  pooled=None if pooled is None else torch.tensor(pooled, dtype=torch.float32))
    return RequestOutput(**fields)
