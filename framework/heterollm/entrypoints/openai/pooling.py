"""The pooling routes: POST /v1/embeddings (OpenAI's shape), /v1/rerank (the Cohere / Jina shape vLLM
serves; also /rerank, /v2/rerank) and /v1/score (vLLM's text_1 / text_2; also /score).

Each input or pair is one engine request, batched by the scheduler like any prompt. A launch that
cannot serve a route answers 400 naming --task (heterollm.pooling.task). Unknown body fields are a
400 naming them: these routes have no refusal table to fall back on.
"""
from __future__ import annotations

import base64
import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from heterollm.engine.async_engine import EngineError
from heterollm.engine.outputs import RequestOutput
from heterollm.entrypoints.openai.protocol import BadRequest, parse_body
from heterollm.pooling import PoolingError, PoolingParams
from heterollm.pooling.scoring import cosine, pair_ids, pair_up
from heterollm.sampling import SamplingParams
from heterollm.scheduler.request import RequestRejected

if TYPE_CHECKING:
    from heterollm.entrypoints.openai.server import OpenAIServer

MAX_INPUTS = 2048
"""Most inputs (or documents, or pairs) one request may carry (OpenAI's limit for embeddings)."""


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class EmbeddingRequest(_Strict):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    """OpenAI's end-user id: opaque, accepted and not used."""
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep the last k tokens of each input (-1: max_model_len)."""
    normalize: bool | None = None
    """vLLM's: L2-normalize (default: the launch's pooler config)."""
    add_special_tokens: bool = True
    """vLLM's: the tokenizer's special tokens (BOS) around text inputs."""


class RerankRequest(_Strict):
    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = None
    """The best n results (None or 0: all)."""
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    instruction: str | None = None
    """Qwen3-Reranker's <Instruct> line (--enable_qwen3_reranker; default: its web-search instruction)."""


class ScoreRequest(_Strict):
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    instruction: str | None = None


class PoolingRoutes:
    """The pooling handlers of one OpenAIServer (its engines, limits, errors and metrics)."""

    def __init__(self, server: OpenAIServer) -> None:
        self.server = server
        self.engine = server.engine

    def register(self, app: FastAPI) -> None:
        routes = [("/v1/embeddings", self.embeddings, EmbeddingRequest)]
        routes += [(p, self.rerank, RerankRequest) for p in ("/v1/rerank", "/rerank", "/v2/rerank")]
        routes += [(p, self.score, ScoreRequest) for p in ("/v1/score", "/score")]
        for path, handler, model in routes:
            app.add_api_route(path, handler, methods=["POST"], openapi_extra={"requestBody": {
                "required": True, "content": {"application/json": {"schema": model.model_json_schema()}}}})

    async def embeddings(self, request: Request) -> Response:
        return await self._guarded(request, self._embeddings)

    async def rerank(self, request: Request) -> Response:
        return await self._guarded(request, self._rerank)

    async def score(self, request: Request) -> Response:
        return await self._guarded(request, self._score)

    async def _guarded(self, request: Request, handler) -> Response:
        """The server's concurrency limit and error mapping around a handler."""
        from heterollm.entrypoints.openai.server import _ClientGone  # the server imports this module

        server = self.server
        limit = server.settings.max_concurrent_requests
        if limit and server.in_flight >= limit:
            return server._error(429, f"the server is at max_concurrent_requests={limit}; retry later")
        server.in_flight += 1
        server.metrics.in_flight.inc()
        try:
            return await handler(request)
        except BadRequest as exc:
            return server._error(exc.status, str(exc), exc.param)
        except (RequestRejected, PoolingError) as exc:
            return server._error(getattr(exc, "status", 400), str(exc), exc.field)
        except EngineError as exc:
            return server._error(500, str(exc))
        except _ClientGone:
            return Response(status_code=499)
        finally:
            server._release()

    # -- /v1/embeddings --------------------------------------------------------------------
    async def _embeddings(self, request: Request) -> Response:
        body: EmbeddingRequest = parse_body(EmbeddingRequest, await request.body())
        self.server._check_model(body.model)
        params = self._resolve(PoolingParams(dimensions=body.dimensions, normalize=body.normalize))
        prompts = self._inputs(body)
        outs = await self._run(request, prompts, params, body.truncate_prompt_tokens, "embd")
        data = [{"index": i, "object": "embedding", "embedding": _encode(o.pooled, body.encoding_format)}
                for i, o in enumerate(outs)]
        tokens = sum(len(o.prompt_token_ids) for o in outs)
        return JSONResponse({"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": self.server.model_name, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    def _inputs(self, body: EmbeddingRequest) -> list[list[int]]:
        raw = body.input
        items: list[str | list[int]] = [raw] if isinstance(raw, str) else list(raw)
        if items and all(isinstance(t, int) for t in items):
            items = [list(items)]  # one prompt of token ids
        if not items:
            raise BadRequest("input must not be empty", "input")
        if len(items) > MAX_INPUTS:
            raise BadRequest(f"input has {len(items)} items; at most {MAX_INPUTS} per request", "input")
        prompts = []
        for i, item in enumerate(items):
            param = "input" if len(items) == 1 else f"input.{i}"
            if isinstance(item, str):
                ids = self.engine.tokenizer.encode(item, body.add_special_tokens) if item else []
            else:
                self.server._check_ids(item, param)
                ids = list(item)
            if not ids:
                raise BadRequest(f"{param} must not be empty", param)
            prompts.append(ids)
        return prompts

    # -- /v1/rerank and /v1/score ----------------------------------------------------------
    async def _rerank(self, request: Request) -> Response:
        body: RerankRequest = parse_body(RerankRequest, await request.body())
        self.server._check_model(body.model)
        if body.top_n is not None and body.top_n < 0:
            raise BadRequest("top_n must be >= 0 (0: every document)", "top_n")
        if not body.documents:
            raise BadRequest("documents must not be empty", "documents")
        pairs = pair_up(body.query, body.documents, ("query", "documents"))
        scores, tokens = await self._scores(request, pairs, body.truncate_prompt_tokens, body.instruction, "rerank")
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: body.top_n or None]
        results = []
        for i in order:
            item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
            if body.return_documents:
                item["document"] = {"text": body.documents[i]}
            results.append(item)
        return JSONResponse({"id": f"rerank-{uuid.uuid4().hex}", "model": self.server.model_name,
                             "usage": {"total_tokens": tokens}, "results": results})

    async def _score(self, request: Request) -> Response:
        body: ScoreRequest = parse_body(ScoreRequest, await request.body())
        self.server._check_model(body.model)
        pairs = pair_up(body.text_1, body.text_2)
        scores, tokens = await self._scores(request, pairs, body.truncate_prompt_tokens, body.instruction, "score")
        data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
        return JSONResponse({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                             "model": self.server.model_name, "data": data,
                             "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})

    async def _scores(self, request: Request, pairs: list[tuple[str, str]], keep: int | None,
                      instruction: str | None, kind: str) -> tuple[list[float], int]:
        """(one score per pair, prompt tokens used): the model on each pair, or the cosine of the two
        sides' embeddings on an embedding launch."""
        if len(pairs) > MAX_INPUTS:
            raise BadRequest(f"{len(pairs)} pairs; at most {MAX_INPUTS} per request", None)
        setup = self.engine.pooling
        params = self._resolve(PoolingParams(task="score"))
        hf = self.engine.tokenizer.hf
        if setup.scores_by_model:
            prompts = [pair_ids(setup, hf, a, b, instruction) for a, b in pairs]
            outs = await self._run(request, prompts, params, keep, kind)
            return [float(o.pooled[0]) for o in outs], sum(len(o.prompt_token_ids) for o in outs)
        if instruction is not None:
            raise BadRequest("instruction is Qwen3-Reranker's (--enable_qwen3_reranker); an embedding launch "
                             "scores by cosine", "instruction")
        texts = [t for pair in pairs for t in pair]
        prompts = [self.engine.tokenizer.encode(t) for t in texts]
        outs = await self._run(request, prompts, self._resolve(PoolingParams()), keep, kind)
        scores = [cosine(outs[2 * i].pooled, outs[2 * i + 1].pooled) for i in range(len(pairs))]
        return scores, sum(len(o.prompt_token_ids) for o in outs)

    # -- shared ----------------------------------------------------------------------------
    def _resolve(self, params: PoolingParams) -> PoolingParams:
        try:
            return self.engine.pooling.resolve(params)
        except RequestRejected as exc:
            raise BadRequest(str(exc), None if exc.field == "task" else exc.field) from None

    async def _run(self, request: Request, prompts: list[list[int]], params: PoolingParams, keep: int | None,
                   kind: str) -> list[RequestOutput]:
        """Admit every prompt (after the length checks), then collect their pooled outputs."""
        limit = self.engine.max_model_len
        sampling = SamplingParams(max_tokens=1, truncate_prompt_tokens=keep) if keep is not None else None
        for i, ids in enumerate(prompts):
            kept = self.server._truncated(None, ids, keep)[1]
            if len(kept) > limit:
                where = f"input {i}" if len(prompts) > 1 else "the input"
                raise BadRequest(f"this model's maximum context length (max_model_len) is {limit} tokens, but {where} "
                                 f"has {len(kept)} tokens; shorten it or set truncate_prompt_tokens", "input")
        request_id = f"{kind}-{uuid.uuid4().hex}"
        streams = []
        try:
            for i, ids in enumerate(prompts):
                replica = self.server._replica(None)
                streams.append(await replica.add(ids, sampling or SamplingParams(max_tokens=1), f"{request_id}-{i}",
                                                 prompt_token_ids=ids,
                                                 first_output_timeout=self.server.settings.max_waiting_time,
                                                 pooling=params))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return await self.server._collect(request, streams)


def _encode(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """float: a JSON list; base64: the little-endian float32 bytes, as OpenAI's client decodes them."""
    if encoding_format == "base64":
        return base64.b64encode(vector.float().numpy().astype("<f4").tobytes()).decode()
    return vector.float().tolist()
