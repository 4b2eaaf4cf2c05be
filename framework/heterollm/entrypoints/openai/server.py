"""The OpenAI-compatible HTTP server (FastAPI): /v1/completions, /v1/chat/completions (streaming
with Server-Sent Events), /v1/embeddings, /v1/rerank, /v1/score (pooling.py), /v1/models, /tokenize,
/detokenize, /health, /metrics.

Every refusal is an OpenAI error body `{"error": {"message", "type", "param", "code"}}` with the
field at fault in `param`; no traceback ever reaches a client, and one bad request never touches
the others in the batch (the engine checks it before admitting it).
"""
from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import time
import uuid
import zlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from heterollm.engine.admission import truncate_prompt
from heterollm.engine.async_engine import AsyncEngine, EngineError, RequestStream
from heterollm.engine.core_client import EngineCoreClient
from heterollm.engine.llm_engine import LLMEngine
from heterollm.engine.outputs import RequestOutput
from heterollm.multimodal import MultiModalItem
from heterollm.multimodal.processor import pixel_kwargs, split_images
from heterollm.scheduler.request import RequestRejected
from heterollm.entrypoints.openai.beam_search import FinishedStream, run_beam_search_request
from heterollm.entrypoints.openai.disagg import (KVTransferFailed, KVTransferRoutes, check_output, failed_events,
                                                 reserve_checks,
                                                 first_outputs, transfer_params)
from heterollm.entrypoints.openai.metrics import ServerMetrics
from heterollm.entrypoints.openai.pooling import PoolingRoutes
from heterollm.entrypoints.openai.profile import ProfileRoutes
from heterollm.entrypoints.openai.protocol import (
    MAX_N, BadRequest, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest, check_messages,
    image_part_locations, parse_body)
from heterollm.entrypoints.openai.responses import ResponseBuilder
from heterollm.entrypoints.openai.structured import StructuredRequestError
from heterollm.entrypoints.openai.weights import WeightRoutes
from heterollm.entrypoints.openai.tools import chat_parsers
from heterollm.sampling import SamplingParams

logger = logging.getLogger("heterollm.server")

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": _ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": status}}


@dataclass
class ServerSettings:
    served_model_names: list[str]
    """The first is reported by /v1/models and in responses; any of them is accepted in `model`."""
    model_root: str = ""
    api_key: str | None = None
    max_concurrent_requests: int = 0
    """0: unlimited."""
    max_waiting_time: float | None = None
    """Seconds a request may wait for its first output before it is refused with 503."""


class _ClientGone(Exception):
    """The client disconnected before its answer was ready."""


class _SSEResponse(StreamingResponse):
    """A Server-Sent Events stream that always runs `cleanup` when it ends, however it ends
    (finished, failed, or the client went away mid-stream, when the events iterator is closed so
    its requests are aborted at once rather than whenever the generator is collected)."""

    def __init__(self, events: AsyncIterator[str], cleanup) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self.body_iterator.aclose()
            finally:
                self._cleanup()


class _ApiKeyMiddleware:
    """Every /v1 route needs `Authorization: Bearer <key>`. A plain ASGI middleware (not
    BaseHTTPMiddleware), so streaming and disconnect detection pass through untouched."""

    def __init__(self, app, server: OpenAIServer) -> None:
        self.app, self.server = app, server
        self.expected = f"Bearer {server.settings.api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                response = self.server._error(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class OpenAIServer:
    """The HTTP front of one engine, or of `--dp_size` engine replicas: each request goes to the
    replica with the fewest outstanding tokens (prompt + tokens still to generate).

    The replicas are either LLMEngines, each stepped by an AsyncEngine thread in this process (the
    offline path and most tests), or EngineCoreClients, each an engine-core process
    (`heterollm serve`)."""

    def __init__(self, engine: LLMEngine | list[LLMEngine] | list[EngineCoreClient], settings: ServerSettings) -> None:
        engines = list(engine) if isinstance(engine, (list, tuple)) else [engine]
        self.settings = settings
        self.model_name = settings.served_model_names[0]
        self.replicas: list[AsyncEngine | EngineCoreClient] = []
        self.metrics = ServerMetrics(self.replicas, self.model_name)
        if isinstance(engines[0], EngineCoreClient):
            self.engine = engines[0].frontend
            """Replica 0 (or the API process's view of it): the tokenizer, chat template and limits
            every replica shares."""
            for client in engines:
                client.on_finished, client.on_aborted = self.metrics.record_finished, self.metrics.record_abort
                client.on_dead = self._engine_died
            self.replicas.extend(engines)
        else:
            self.engine = engines[0]
            self.replicas.extend(AsyncEngine(e, on_finished=self.metrics.record_finished,
                                             on_aborted=self.metrics.record_abort, on_dead=self._engine_died)
                                 for e in engines)
        self.async_engine = self.replicas[0]
        self.on_engine_dead: Any = None
        """Set by `heterollm serve`: stops the HTTP server when the engine's workers are gone."""
        self.in_flight = 0
        self.created = int(time.time())
        self.defaults = dict(self.engine.source.generation_defaults)
        self.parsers = chat_parsers(self.engine)
        """--tool_call_parser / --reasoning_parser (a ConfigError naming the flag when one cannot be served)."""
        self.app = self._build_app()

    # -- app -------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        @asynccontextmanager
        async def lifespan(_: FastAPI):
            for replica in self.replicas:
                replica.start()
            yield
            for replica in self.replicas:
                replica.shutdown()

        app = FastAPI(title="heterollm", lifespan=lifespan)
        app.state.server = self

        @app.exception_handler(StarletteHTTPException)
        async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
            return self._error(exc.status_code, str(exc.detail))

        @app.exception_handler(RequestValidationError)
        async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            loc = [str(x) for x in first.get("loc", ())[1:]]
            return self._error(400, first.get("msg", "invalid request"), ".".join(loc) or None)

        @app.exception_handler(Exception)
        async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
            logger.exception("unhandled error")
            return self._error(500, f"internal error: {type(exc).__name__}")

        if self.settings.api_key:
            app.add_middleware(_ApiKeyMiddleware, server=self)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics_endpoint, methods=["GET"])
        app.add_api_route("/version", self.version, methods=["GET"])
        app.add_api_route("/v1/models", self.models, methods=["GET"])
        for path, handler, model in (("/v1/completions", self.completions, CompletionRequest),
                                     ("/v1/chat/completions", self.chat_completions, ChatCompletionRequest),
                                     ("/tokenize", self.tokenize, TokenizeRequest),
                                     ("/detokenize", self.detokenize, DetokenizeRequest)):
            app.add_api_route(path, handler, methods=["POST"], openapi_extra={"requestBody": {
                "required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}})
        PoolingRoutes(self).register(app)
        WeightRoutes(self).register(app)
        self.kv_routes = KVTransferRoutes(self)
        self.kv_routes.register(app)
        ProfileRoutes(self).register(app)
        return app

    def _error(self, status: int, message: str, param: str | None = None) -> JSONResponse:
        if status >= 400:
            self.metrics.record_error(status)
        return JSONResponse(error_body(status, message, param), status_code=status)

    # -- small routes ----------------------------------------------------------------------
    def _engine_died(self, why: str) -> None:
        if self.on_engine_dead is not None:
            self.on_engine_dead(why)

    async def health(self) -> Response:
        for rank, replica in enumerate(self.replicas):
            if not replica.alive:
                where = f" (dp rank {rank})" if len(self.replicas) > 1 else ""
                return self._error(503, f"the engine{where} is not running" + (f": {replica.dead}" if replica.dead
                                                                                else ""))
        return Response(status_code=200)

    async def version(self) -> dict[str, str]:
        from importlib.metadata import version
        return {"version": version("heterollm")}

    async def metrics_endpoint(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def models(self) -> dict[str, Any]:
        data = [{"id": name, "object": "model", "created": self.created, "owned_by": "heterollm",
                 "root": self.settings.model_root or name, "parent": None,
                 "max_model_len": self.engine.max_model_len} for name in self.settings.served_model_names]
        return {"object": "list", "data": data}

    async def tokenize(self, request: Request) -> Any:
        try:
            body = parse_body(TokenizeRequest, await request.body())
            self._check_model(body.model)
            if (body.prompt is None) == (body.messages is None):
                raise BadRequest("give exactly one of prompt or messages", "prompt")
            if body.messages is not None:
                check_messages(body.messages)
                ids, images = self._chat_prompt(body.messages, body.add_generation_prompt,
                                                body.continue_final_message, body.chat_template,
                                                body.chat_template_kwargs)
                ids, _ = await self._with_images(ids, images, body)
            else:
                ids = self.engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        except BadRequest as exc:
            return self._error(exc.status, str(exc), exc.param)
        except RequestRejected as exc:
            return self._error(exc.status, str(exc), exc.field)
        strs = self.engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids, "token_strs": strs}

    async def detokenize(self, request: Request) -> Any:
        try:
            body = parse_body(DetokenizeRequest, await request.body())
            self._check_model(body.model)
            self._check_ids(body.tokens, "tokens")
        except BadRequest as exc:
            return self._error(exc.status, str(exc), exc.param)
        return {"prompt": self.engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    # -- shared checks ---------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        if model is not None and model not in self.settings.served_model_names:
            raise BadRequest(f"the model {model!r} does not exist; this server serves "
                             f"{', '.join(repr(n) for n in self.settings.served_model_names)}", "model", 404)

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.engine.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"{param}: token id {bad[0]} is outside the vocabulary [0, {vocab})", param)

    def _chat_prompt(self, messages, add_generation_prompt: bool, continue_final_message: bool,
                     chat_template: str | None, template_kwargs: dict[str, Any] | None,
                     template_vars: dict[str, Any] | None = None,
                     add_special_tokens: bool = False) -> tuple[list[int], list[str]]:
        """(the rendered prompt's ids, the URLs of its image parts in order): each image part renders as
        the template's image placeholder, expanded later by `_with_images`."""
        mm = self.engine.multimodal
        locations = image_part_locations(messages)
        if locations and mm.processor is None:  # before the template, which may not render image parts
            raise BadRequest(f"the model {mm.model_name} is text-only: it takes no images (serve a "
                             f"vision-language model, e.g. Qwen2-VL)", locations[0])
        conv, images = split_images([m.as_template_message() for m in messages])
        kwargs = dict(template_kwargs or {})
        if continue_final_message:
            kwargs["continue_final_message"] = True
        for name, value in (template_vars or {}).items():  # request fields the template reads (vLLM's way)
            if value is None:
                continue
            if name not in str(chat_template or self.engine.tokenizer.hf.chat_template or ""):
                raise BadRequest(f"{name}: the chat template does not read `{name}`, so it would change nothing",
                                 name)
            kwargs[name] = value
        try:
            return self.engine.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                             chat_template=chat_template,
                                                             add_special_tokens=add_special_tokens, **kwargs), images
        except ValueError as exc:
            raise BadRequest(str(exc).removeprefix("messages: "), "messages") from None
        except Exception as exc:  # a template that raises on these messages (jinja errors and the like)
            raise BadRequest(f"the chat template failed on these messages: {exc}", "messages") from None

    async def _with_images(self, ids: list[int], images: list[str],
                           body: ChatCompletionRequest | TokenizeRequest) -> tuple[list[int], list[MultiModalItem]]:
        """The prompt with each image placeholder expanded, and the images preprocessed
        (multimodal.processor.MultiModalInputs.admit, off the event loop: it fetches http(s) URLs, with
        --mm_download_headers overlaid by the request's mm_download_headers). A refusal names the image
        part (`messages.{i}.content.{j}`), or mm_processor_kwargs; other requests are unaffected."""
        mm = self.engine.multimodal
        kwargs = body.mm_processor_kwargs
        if kwargs:
            if mm.processor is None:
                raise BadRequest(f"mm_processor_kwargs: the model {mm.model_name} is text-only: it has no image "
                                 f"processor", "mm_processor_kwargs")
            try:
                pixel_kwargs(kwargs, "mm_processor_kwargs")
            except ValueError as exc:
                raise BadRequest(str(exc), "mm_processor_kwargs") from None
        if mm.processor is None and not images:
            return ids, []
        try:
            return await asyncio.to_thread(mm.admit, ids, {"image": images}, kwargs, "messages",
                                           body.mm_download_headers)
        except RequestRejected as exc:
            field = _image_field(exc.field, image_part_locations(body.messages), mm.processor is None)
            raise RequestRejected(field, str(exc), exc.status) from None

    def _max_tokens(self, prompt_len: int, requested: int | None, prompt_param: str,
                    max_tokens_param: str) -> int:
        limit = self.engine.max_model_len
        if prompt_len >= limit:
            raise BadRequest(f"this model's maximum context length (max_model_len) is {limit} tokens, but the "
                             f"{prompt_param} has {prompt_len} tokens", prompt_param)
        if requested is None:
            return limit - prompt_len
        if not isinstance(requested, int) or requested < 1:
            raise BadRequest(f"{max_tokens_param} must be an integer >= 1, got {requested!r}", max_tokens_param)
        if prompt_len + requested > limit:
            raise BadRequest(f"this model's maximum context length (max_model_len) is {limit} tokens; you asked "
                             f"for {prompt_len + requested} ({prompt_len} in the {prompt_param}, {requested} in "
                             f"{max_tokens_param}); lower {max_tokens_param}", max_tokens_param)
        return requested

    def _truncated(self, text: str | None, ids: list[int], keep: int | None) -> tuple[str | None, list[int]]:
        """vLLM's truncate_prompt_tokens: the last `keep` prompt tokens (before the length checks); a
        text prompt that lost tokens is then known by the ones kept (an echo shows those)."""
        kept = truncate_prompt(ids, keep, self.engine.max_model_len)
        return (text if len(kept) == len(ids) else None), kept

    @lru_cache(maxsize=65536)
    def _token_str(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    # -- generation ------------------------------------------------------------------------
    async def _admit(self, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                     request_id: str, body: Any, mm_items: list[MultiModalItem] | None = None,
                     kv_transfer_params: dict[str, Any] | None = None) -> list[RequestStream]:
        """Admit each prompt (`mm_items`: the images of a single prompt, already preprocessed;
        `kv_transfer_params`: disagg.transfer_params, for a single prompt)."""
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                # each prompt gets its own copy: the engine fills in max_tokens per request
                p = dataclasses.replace(params)
                replica = self._replica(getattr(body, "prompt_cache_key", None), kv_transfer_params)
                streams.append(await replica.add(text if text is not None else ids, p, rid,
                                                           prompt_token_ids=ids,
                                                           first_output_timeout=self.settings.max_waiting_time,
                                                           priority=body.priority, ttft_slo_ms=body.ttft_slo_ms,
                                                           mm_items=mm_items or None,
                                                           kv_transfer_params=kv_transfer_params))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return streams

    def _replica(self, prompt_cache_key: str | None,
                 kv_transfer_params: dict[str, Any] | None = None) -> AsyncEngine | EngineCoreClient:
        """The replica for a request: the one with the least outstanding work, or, for a request with a
        prompt_cache_key, the one that key always maps to (so it finds the prefixes its key cached),
        or, for a PD PUSH answer, the one holding its reservation."""
        kv = kv_transfer_params or {}
        replica = kv.get("reservation_replica")
        if kv.get("do_remote_prefill") and isinstance(replica, int) and 0 <= replica < len(self.replicas) \
                and self.replicas[replica].alive:
            return self.replicas[replica]
        alive = [r for r in self.replicas if r.alive] or self.replicas[:1]
        if prompt_cache_key is not None:
            return alive[zlib.crc32(prompt_cache_key.encode()) % len(alive)]
        return min(alive, key=lambda r: r.load)

    async def _run(self, request: Request, kind: str) -> Response:
        refusal = self.engine.pooling.generation_refusal()  # --task embed, a classifier checkpoint
        if refusal is not None:
            return self._error(400, refusal)
        limit = self.settings.max_concurrent_requests
        if limit and self.in_flight >= limit:
            return self._error(429, f"the server is at max_concurrent_requests={limit}; retry later")
        self.in_flight += 1
        self.metrics.in_flight.inc()
        release = True
        try:
            handler = self._completions if kind == "completions" else self._chat
            response = await handler(request)
            if isinstance(response, StreamingResponse):
                release = False  # the stream releases its slot when it ends
            return response
        except BadRequest as exc:
            return self._error(exc.status, str(exc), exc.param)
        except RequestRejected as exc:
            if exc.status == 502:  # a PD reservation gone: the router runs the flow again
                self.metrics.record_error(502)
                return JSONResponse(KVTransferFailed(str(exc)).body(), status_code=502)
            return self._error(exc.status, str(exc), exc.field)
        except StructuredRequestError as exc:
            return self._error(400, str(exc), exc.field)
        except EngineError as exc:
            return self._error(500, str(exc))
        except KVTransferFailed as exc:
            self.metrics.record_error(exc.status)
            return JSONResponse(exc.body(), status_code=exc.status)
        except _ClientGone:
            return Response(status_code=499)
        finally:
            if release:
                self._release()

    def _release(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()

    async def completions(self, request: Request) -> Response:
        return await self._run(request, "completions")

    async def chat_completions(self, request: Request) -> Response:
        return await self._run(request, "chat")

    async def _completions(self, request: Request) -> Response:
        body: CompletionRequest = parse_body(CompletionRequest, await request.body())
        body.check()
        self._check_model(body.model)
        prompts: list[tuple[str | None, list[int]]] = []
        for p in body.prompts():
            if isinstance(p, str):
                prompts.append((p, self.engine.tokenizer.encode(p, body.add_special_tokens)))
            else:
                self._check_ids(p, "prompt")
                prompts.append((None, list(p)))
        if any(not ids for _, ids in prompts):
            raise BadRequest("prompt must not be empty", "prompt")
        if self.engine.multimodal.processor is not None:  # image placeholders without images: refused
            for _, ids in prompts:
                try:
                    self.engine.multimodal.admit(ids, None, field="prompt")
                except RequestRejected as exc:
                    raise BadRequest(f"{exc}; /v1/completions takes text only: send images to "
                                     f"/v1/chat/completions as image_url parts", "prompt") from None
        prompts = [self._truncated(text, ids, body.truncate_prompt_tokens) for text, ids in prompts]
        name, per_prompt = ("best_of", body.best_of) if body.best_of else ("n", body.n)
        if len(prompts) * per_prompt > MAX_N:
            raise BadRequest(f"{len(prompts)} prompts x {name}={per_prompt} completions is more than {MAX_N}", name)
        longest = max(len(ids) for _, ids in prompts)
        requested = body.max_tokens
        if "max_tokens" not in body.model_fields_set:  # OpenAI's default of 16, clamped to the context left
            requested = max(1, min(16, self.engine.max_model_len - longest))
        max_tokens = self._max_tokens(longest, requested, "prompt", "max_tokens")
        kv_params = transfer_params(body, len(prompts))
        if kv_params and kv_params.get("reserve"):
            reserve_checks(body, body.logprobs)
            return await self.kv_routes.reserve(prompts[0][1])
        if body.use_beam_search:
            return await self._beam_search(request, body, prompts, max_tokens, "text_completion")
        want_prompt_lps = body.requested_prompt_logprobs(body.logprobs if body.echo else None)
        params = body.sampling_params(self.defaults, max_tokens, body.logprobs, want_prompt_lps, "logprobs")
        params.structured_outputs = body.structured_spec()
        request_id = f"cmpl-{body.request_id or uuid.uuid4().hex}"
        streams = await self._admit(prompts, params, request_id, body, kv_transfer_params=kv_params)
        if body.stream and kv_params:  # a failed KV pull is the stream's first event
            streams, failed = await first_outputs(streams)
            if failed is not None:
                return self._sse(failed_events(failed), streams)
        ctx = ResponseBuilder(self, request_id, "text_completion", body, prompts, streams, body.logprobs)
        if body.stream:
            return self._sse(ctx.stream_completion(), streams)
        outs = await self._collect(request, streams)
        return JSONResponse(ctx.completion_response(outs))

    async def _chat(self, request: Request) -> Response:
        body: ChatCompletionRequest = parse_body(ChatCompletionRequest, await request.body())
        body.check()
        self._check_model(body.model)
        plan, functions, forced = self.parsers.plan(body)
        template_kwargs = {**(body.chat_template_kwargs or {}), **({"tools": body.tools} if functions else {})}
        ids, images = self._chat_prompt(body.messages, body.add_generation_prompt, body.continue_final_message,
                                        body.chat_template, template_kwargs,
                                        {"reasoning_effort": body.reasoning_effort, "documents": body.documents},
                                        body.add_special_tokens)
        if images and body.truncate_prompt_tokens is not None:
            raise BadRequest("truncate_prompt_tokens: cannot cut a prompt that carries images",
                             "truncate_prompt_tokens")
        if images and body.use_beam_search:
            raise BadRequest("use_beam_search: beam search over a prompt with images is not supported",
                             "use_beam_search")
        ids, mm_items = await self._with_images(ids, images, body)
        _, ids = self._truncated(None, ids, body.truncate_prompt_tokens)
        max_tokens = self._max_tokens(len(ids), body.requested_max_tokens(), "messages",
                                      "max_completion_tokens" if body.max_completion_tokens is not None
                                      else "max_tokens")
        top = (body.top_logprobs or 0) if body.logprobs else None  # the alternatives asked for, or no logprobs
        kv_params = transfer_params(body, 1)
        if kv_params and kv_params.get("reserve"):
            if mm_items:
                raise BadRequest("kv_transfer_params: a prompt with images is not served disaggregated",
                                 "kv_transfer_params")
            reserve_checks(body, top)
            return await self.kv_routes.reserve(ids)
        if body.use_beam_search:
            return await self._beam_search(request, body, [(None, ids)], max_tokens, "chat.completion")
        params = body.sampling_params(self.defaults, max_tokens, top, body.requested_prompt_logprobs(), "top_logprobs")
        params.structured_outputs = body.structured_spec()
        self.parsers.prepare(plan, forced, params, body, ids, self.engine.tokenizer)
        request_id = f"chatcmpl-{body.request_id or uuid.uuid4().hex}"
        streams = await self._admit([(None, ids)], params, request_id, body, mm_items, kv_params)
        if body.stream and kv_params:  # a failed KV pull is the stream's first event
            streams, failed = await first_outputs(streams)
            if failed is not None:
                return self._sse(failed_events(failed), streams)
        ctx = ResponseBuilder(self, request_id, "chat.completion", body, [(None, ids)], streams, top, plan)
        if body.stream:
            return self._sse(ctx.stream_chat(), streams)
        outs = await self._collect(request, streams)
        return JSONResponse(ctx.chat_response(outs[0]))

    async def _beam_search(self, request: Request, body: Any, prompts: list[tuple[str | None, list[int]]],
                           max_tokens: int, obj: str) -> Response:
        """use_beam_search: the whole search, then the response (chat may stream it; see beam_search.py)."""
        prefix = "cmpl" if obj == "text_completion" else "chatcmpl"
        request_id = f"{prefix}-{getattr(body, 'request_id', None) or uuid.uuid4().hex}"
        outs = await run_beam_search_request(self, request, body, prompts, max_tokens, request_id)
        streams = [FinishedStream(out) for out in outs]
        ctx = ResponseBuilder(self, request_id, obj, body, prompts, streams, None)
        if obj == "text_completion":
            return JSONResponse(ctx.completion_response(outs))
        return self._sse(ctx.stream_chat(), streams) if body.stream else JSONResponse(ctx.chat_response(outs[0]))

    async def _collect(self, request: Request, streams: list[RequestStream]) -> list[RequestOutput]:
        """Run every stream to its finished output; a client that disconnects aborts them all."""
        async def last(stream: RequestStream) -> RequestOutput:
            final = None
            async for out in stream:
                final = out
            return final

        task = asyncio.gather(*(last(s) for s in streams))
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    outs = task.result()
                    break
                if await request.is_disconnected():
                    logger.info("client went away; aborting its request")
                    task.cancel()
                    raise _ClientGone
        finally:
            for s in streams:
                s.close()
        for out in outs:
            check_output(out)
            if any(c.finish_reason == "abort" for c in out.outputs):
                raise RequestRejected("request", "the request could not be scheduled: it needs more KV cache "
                                                 "than the engine has", status=503)
        return outs

    def _sse(self, events: AsyncIterator[dict[str, Any]], streams: list[RequestStream]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for event in events:
                    yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            except (RequestRejected, EngineError, KVTransferFailed) as exc:  # after the 200 went out: an error event
                status = getattr(exc, "status", 500)
                self.metrics.record_error(status)
                body = exc.body() if isinstance(exc, KVTransferFailed) else error_body(status, str(exc),
                                                                                       getattr(exc, "field", None))
                yield f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
            finally:
                await events.aclose()
            yield "data: [DONE]\n\n"

        released = []

        def cleanup() -> None:
            for s in streams:
                s.close()
            if not released:
                released.append(True)
                self._release()

        return _SSEResponse(body(), cleanup)


def _image_field(field: str, locations: list[str], text_only: bool) -> str:
    """MultiModalInputs.admit's field for the images of a chat (`messages.image[.k...]`, k counting image
    parts) -> the part at fault: `messages.{i}.content.{j}[...]`. A refusal of the images as a whole (too
    many, placeholders that do not match) names `messages`; a text-only model names the first image part."""
    head, _, rest = field.removeprefix("messages.image").lstrip(".").partition(".")
    if not field.startswith("messages.image"):
        return field
    if head.isdigit() and int(head) < len(locations):
        return ".".join(filter(None, [locations[int(head)], rest]))
    return locations[0] if text_only and locations else "messages"


def build_server(engine: LLMEngine, settings: ServerSettings) -> OpenAIServer:
    return OpenAIServer(engine, settings)
