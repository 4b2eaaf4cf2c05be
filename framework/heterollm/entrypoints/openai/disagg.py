"""Prefill/decode disaggregation at the API server (the PULL protocol `heterollm route` drives).

A request's `kv_transfer_params` goes to the engine as it is (LLMEngine.add_request): on a PREFILL
instance `{"do_remote_decode": true}` makes the answer carry a top-level `kv_transfer_params` for the
DECODE instance, and the KV blocks stay held until `POST /v1/kv_transfer/release`
`{"remote_request_id": ...}` (answered `{"released": bool}`; every --dp_size replica is asked, since
only the one that computed the prompt holds its blocks). On a DECODE instance a request whose pull
failed ends with finish_reason "error": the answer is a 502 with type "kv_transfer_failed", or, when
streamed, that error as the first event (the first output is awaited before anything is sent).

PUSH: a DECODE instance answers a request whose kv_transfer_params say `{"do_remote_prefill": true,
"reserve": true}` at once with `{"kv_transfer_params": <reservation>}` (LLMEngine.reserve_kv) instead of
generating; the PREFILL instance's request carries that reservation, and a push that failed is its
502 kv_transfer_failed; the DECODE instance's own request then carries the PREFILL instance's answer
(plus `reservation_replica`). `/v1/kv_transfer/release` frees an unclaimed reservation too.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from heterollm.engine.async_engine import EngineError
from heterollm.engine.outputs import RequestOutput
from heterollm.scheduler.request import RequestRejected

KV_TRANSFER_FAILED = "kv_transfer_failed"
"""The error type of a request whose KV cache could not be pulled (the router retries on another P)."""


class KVTransferFailed(Exception):
    """A request ended with finish_reason "error" (RequestOutput.error says why)."""

    status = 502
    field = "kv_transfer_params"

    def body(self) -> dict[str, Any]:
        return {"error": {"message": str(self), "type": KV_TRANSFER_FAILED, "param": self.field, "code": self.status}}


def check_output(out: RequestOutput) -> None:
    """Raise KVTransferFailed when one of `out`'s completions finished with "error"."""
    if any(c.finish_reason == "error" for c in out.outputs):
        raise KVTransferFailed(out.error or "the KV cache transfer failed")


def transfer_params(body: Any, num_prompts: int) -> dict[str, Any] | None:
    """The request's kv_transfer_params for the engine (None when absent or empty); BadRequest-style
    RequestRejected for the combinations no instance serves."""
    params = body.kv_transfer_params
    if not params:
        return None
    if num_prompts != 1:
        raise RequestRejected("kv_transfer_params", "one prompt per request: a batch of prompts cannot "
                                                    "be prefilled on one instance and decoded on another")
    if body.use_beam_search:
        raise RequestRejected("kv_transfer_params", "beam search does not run disaggregated")
    return params


def reserve_checks(body: Any, logprobs: int | None) -> None:
    """What a DECODE instance would refuse once the prefill is done, refused before any block is
    reserved (BadRequest-style RequestRejected naming the field)."""
    if getattr(body, "n", 1) != 1 or getattr(body, "best_of", None) not in (None, 1):  # n = 0 too: D refuses it
        raise RequestRejected("n", "a disaggregated request generates one sequence (n = 1, best_of = 1)")
    if logprobs is not None or getattr(body, "prompt_logprobs", None) is not None:
        raise RequestRejected("logprobs", "a disaggregated request's first token is sampled by the prefill instance, "
                              "which sends no logprobs: logprobs are not served with kv_transfer_params")


class FirstOutputStream:
    """A stream whose first output was awaited (and checked) before the response started, so a failed
    KV pull is a stream's first event; iterating it gives that output, then the rest."""

    def __init__(self, stream: Any, it: AsyncIterator[RequestOutput], first: RequestOutput) -> None:
        self.stream, self._it, self.first = stream, it, first

    @classmethod
    async def of(cls, stream: Any) -> FirstOutputStream:
        it = stream.__aiter__()
        first = await it.__anext__()
        return cls(stream, it, first)

    def close(self) -> None:
        self.stream.close()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        yield self.first
        if not self.first.finished:
            async for out in self._it:
                yield out


class KVTransferRoutes:
    def __init__(self, server: Any) -> None:
        self.server = server

    def register(self, app: FastAPI) -> None:
        app.add_api_route("/v1/kv_transfer/release", self.release, methods=["POST"])

    async def reserve(self, prompt_token_ids: list[int]) -> Response:
        """PD PUSH, on a DECODE instance: a generation request whose kv_transfer_params say
        `"reserve": true` is answered at once with a block reservation for its prompt (on the least
        loaded replica, which its later request goes back to: `reservation_replica`), or, under
        --kv_cache_transfer_mode=PULL, with only that mode. RequestRejected propagates (a 400, or 503
        with no room)."""
        server = self.server
        alive = [i for i, r in enumerate(server.replicas) if r.alive] or [0]
        i = min(alive, key=lambda k: server.replicas[k].load)
        params = await server.replicas[i].utility("reserve_kv", list(prompt_token_ids))
        if "reservation_id" in params:
            params["reservation_replica"] = i
        return JSONResponse({"kv_transfer_params": params})

    async def release(self, request: Request) -> Response:
        server = self.server
        try:
            fields = json.loads(await request.body() or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return server._error(400, f"the request body is not JSON: {exc}")
        request_id = fields.get("remote_request_id") if isinstance(fields, dict) else None
        if not isinstance(request_id, str) or not request_id:
            return server._error(400, "remote_request_id must be a non-empty string (kv_transfer_params."
                                      "remote_request_id of the prefill answer)", "remote_request_id")
        released = False
        try:
            for replica in server.replicas:  # the one that computed the prompt holds the blocks
                if replica.alive and await replica.utility("release_kv", request_id):
                    released = True
        except RequestRejected as exc:
            return server._error(exc.status, str(exc), exc.field)
        except EngineError as exc:
            return server._error(503, str(exc))
        return JSONResponse({"released": released})


async def first_outputs(streams: list[Any]) -> tuple[list[Any], KVTransferFailed | None]:
    """Each stream as a FirstOutputStream, and the failure of the first one that failed its KV pull."""
    checked: list[Any] = []
    try:
        for stream in streams:
            checked.append(await FirstOutputStream.of(stream))
    except BaseException:
        for stream in streams:
            stream.close()
        raise
    for stream in checked:
        try:
            check_output(stream.first)
        except KVTransferFailed as exc:
            return checked, exc
    return checked, None


async def failed_events(exc: KVTransferFailed) -> AsyncIterator[dict[str, Any]]:
    """A stream of events that is only its failure (the SSE writer turns it into the error event)."""
    raise exc
    yield {}  # an async generator, never reached
