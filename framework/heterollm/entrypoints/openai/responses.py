"""The OpenAI response bodies of one generation request: ids, names, usage, logprobs, whole
responses and SSE chunks (streams of several prompts and choices merged in arrival order)."""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from heterollm.engine.async_engine import RequestStream
from heterollm.entrypoints.openai.disagg import check_output
from heterollm.engine.outputs import RequestOutput
from heterollm.interfaces import TokenLogprobs

if TYPE_CHECKING:
    from heterollm.entrypoints.openai.tools import RequestParsing


class ResponseBuilder:
    """One generation request's response building: ids, names, usage, logprobs, chunks."""

    def __init__(self, server: Any, request_id: str, obj: str, body: Any,
                 prompts: list[tuple[str | None, list[int]]], streams: list[RequestStream],
                 logprobs: int | None, parsing: RequestParsing | None = None) -> None:
        self.server, self.id, self.object, self.body = server, request_id, obj, body
        self.parsing = parsing
        """Chat: how each choice splits into reasoning_content, content and tool_calls (None: all content)."""
        self.prompts, self.streams, self.logprobs = prompts, streams, logprobs
        self.created = int(time.time())
        self.model = server.model_name
        self.n = body.n
        self.as_ids = bool(getattr(body, "return_tokens_as_token_ids", False))
        """vLLM's return_tokens_as_token_ids: logprobs name tokens "token_id:<id>"."""
        self.token_ids = bool(getattr(body, "return_token_ids", False))
        """vLLM's return_token_ids: choices carry their token ids, responses their prompt's."""

    # -- pieces ----------------------------------------------------------------------------
    def _usage(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def _name(self, token_id: int) -> str:
        """A token as logprobs write it: its text, or "token_id:<id>" (return_tokens_as_token_ids)."""
        return f"token_id:{token_id}" if self.as_ids else self.server._token_str(token_id)

    def _completion_logprobs(self, lps: list[tuple[int, TokenLogprobs | None]], offset: int) -> dict[str, Any]:
        """OpenAI's legacy logprobs object; (token id, logprobs) pairs, None for the first prompt token."""
        tokens, token_lps, tops, offsets = [], [], [], []
        pos = offset
        tok = self._name
        for token_id, lp in lps:
            s = tok(token_id)
            tokens.append(s)
            offsets.append(pos)
            pos += len(self.server._token_str(token_id))  # offsets into the text, whatever the names
            if lp is None:
                token_lps.append(None)
                tops.append(None)
                continue
            token_lps.append(lp.logprob)
            top = {tok(t): v for t, v in lp.top[: self.logprobs or 0]}
            top.setdefault(s, lp.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chat_logprobs(self, lps: list[TokenLogprobs]) -> dict[str, Any]:
        def entry(t: int, v: float) -> dict[str, Any]:
            return {"token": self._name(t), "logprob": v, "bytes": list(self.server._token_str(t).encode("utf-8"))}

        return {"content": [{**entry(lp.token_id, lp.logprob),
                             "top_logprobs": [entry(t, v) for t, v in lp.top[: self.logprobs or 0]]}
                            for lp in lps]}

    @staticmethod
    def _prompt_pairs(out: RequestOutput) -> list[tuple[int, TokenLogprobs | None]]:
        lps = list(out.prompt_logprobs or [])
        lps += [None] * (len(out.prompt_token_ids) - len(lps))
        return list(zip(out.prompt_token_ids, lps))

    def _vllm_prompt_logprobs(self, out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's `prompt_logprobs` (per completion choice, top level in chat): per prompt token null
        (the first) or {token id: {"logprob", "rank", "decoded_token"}}, the prompt's own token first,
        then the top k with ranks 1..k; k is `prompt_logprobs`, else the echo's `logprobs`."""
        if out.prompt_logprobs is None:
            return None
        asked = getattr(self.body, "prompt_logprobs", None)
        k = asked if asked is not None else (self.logprobs or 0)
        return [None if lp is None else self._logprob_entries(token_id, lp, k)
                for token_id, lp in self._prompt_pairs(out)]

    def _logprob_entries(self, token_id: int, lp: TokenLogprobs, k: int) -> dict[str, dict[str, Any]]:
        def entry(t: int, logprob: float, rank: int) -> dict[str, Any]:
            # vLLM writes -inf as -9999.0 (JSON has no infinity)
            return {"logprob": max(logprob, -9999.0), "rank": rank, "decoded_token": self.server._token_str(t)}

        entries = {str(token_id): entry(token_id, lp.logprob, lp.rank)}
        for rank, (t, v) in enumerate(lp.top[:k], start=1):
            entries[str(t)] = entry(t, v, rank)  # the prompt's token among them keeps its first place
        return entries

    def _prompt_text(self, i: int) -> str:
        text, ids = self.prompts[i]
        return text if text is not None else self.server.engine.tokenizer.decode(ids, skip_special_tokens=False)

    # -- whole responses -------------------------------------------------------------------
    def completion_response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, out in enumerate(outs):
            prompt_tokens += len(out.prompt_token_ids)
            prefix = self._prompt_text(i) if self.body.echo else ""
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                logprobs = None
                if self.logprobs is not None:
                    lps = self._prompt_pairs(out) if self.body.echo else []
                    lps += [(lp.token_id, lp) for lp in c.logprobs or []]
                    logprobs = self._completion_logprobs(lps, 0)
                choice = {"index": i * self.n + c.index, "text": prefix + c.text, "logprobs": logprobs,
                          "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                if self.token_ids:
                    choice.update(prompt_token_ids=list(out.prompt_token_ids), token_ids=list(c.token_ids))
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(out)
                choices.append(choice)
        response = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": choices,
                    "usage": self._usage(prompt_tokens, completion_tokens,
                                         sum(o.metrics.num_cached_tokens for o in outs))}
        return _with_transfer_params(response, outs)

    def chat_response(self, out: RequestOutput) -> dict[str, Any]:
        choices, completion_tokens = [], 0
        prefix = self._echo_prefix()
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            message, finish_reason = self._message(c.text, c.finish_reason)
            if prefix:
                message["content"] = prefix + (message["content"] or "")
            choices.append({"index": c.index, "message": message,
                            "logprobs": self._chat_logprobs(c.logprobs or []) if self.logprobs is not None else None,
                            "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                            **({"token_ids": list(c.token_ids)} if self.token_ids else {})})
        response = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                    "choices": choices,
                    "usage": self._usage(len(out.prompt_token_ids), completion_tokens, out.metrics.num_cached_tokens)}
        if self.token_ids:
            response["prompt_token_ids"] = list(out.prompt_token_ids)
        response["prompt_logprobs"] = self._vllm_prompt_logprobs(out)
        return _with_transfer_params(response, [out])

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole chat choice's message and finish_reason ("tool_calls" when it called tools and stopped)."""
        if self.parsing is None:
            return {"role": "assistant", "content": text}, finish_reason
        parsed = self.parsing.choice().result(text)
        message: dict[str, Any] = {"role": "assistant", "content": parsed.content}  # null when only whitespace
        if parsed.reasoning is not None and self.parsing.include_reasoning:
            message["reasoning_content"] = parsed.reasoning
        if parsed.calls:
            message["tool_calls"] = [call.as_openai() for call in parsed.calls]
            finish_reason = "tool_calls" if finish_reason == "stop" else finish_reason
        return message, finish_reason

    def _chat_deltas(self, parser: Any, c: Any, num_calls: int) -> list[dict[str, Any]]:
        """One step's deltas of a streamed chat choice: reasoning and content together, then per new tool
        call its index, id, type and name (arguments ""), then its arguments, as OpenAI's client
        accumulates them."""
        if parser is None:
            return [{"content": c.delta_text}] if c.delta_text else []
        delta = parser.update(c.text, c.finish_reason is not None)
        text = {}
        if delta.reasoning and self.parsing.include_reasoning:
            text["reasoning_content"] = delta.reasoning
        if delta.content:
            text["content"] = delta.content
        deltas = [text] if text else []
        for k, call in enumerate(delta.calls, start=num_calls):
            head = call.as_openai()
            head["function"]["arguments"] = ""
            deltas.append({"tool_calls": [{"index": k, **head}]})
            deltas.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
        return deltas

    def _echo_prefix(self) -> str:
        """vLLM's chat echo: the content of a final assistant message the answer continues."""
        if not self.body.echo:
            return ""
        last = self.body.messages[-1]
        if last.role != "assistant":
            return ""
        return last.as_template_message()["content"]

    # -- streams ---------------------------------------------------------------------------
    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        if len(self.streams) == 1:
            async for out in self.streams[0]:
                check_output(out)
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream) -> None:
            try:
                async for out in s:
                    q.put_nowait((i, out))
            except Exception as exc:
                q.put_nowait((i, exc))
            finally:
                q.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(self.streams)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await q.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    check_output(item)
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in self.streams:
                s.close()

    def _stream_opts(self) -> tuple[bool, bool]:
        o = self.body.stream_options
        return (bool(o and o.include_usage), bool(o and o.continuous_usage_stats))

    def _chunk(self, obj: str, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> dict:
        chunk = {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}
        if usage is not None:
            chunk["usage"] = usage
        return chunk

    async def stream_completion(self) -> AsyncIterator[dict[str, Any]]:
        include_usage, continuous = self._stream_opts()
        prompt_tokens = sum(len(ids) for _, ids in self.prompts)
        generated: dict[int, int] = {}
        sent_echo: set[int] = set()
        offsets: dict[int, int] = {}
        cached: dict[int, int] = {}
        try:
            async for i, out in self._merged():
                cached[i] = out.metrics.num_cached_tokens
                for c in out.outputs:
                    index = i * self.n + c.index
                    text = c.delta_text
                    lps = []
                    done = generated.get(index, 0)
                    if self.logprobs is not None:
                        lps = [(lp.token_id, lp) for lp in (c.logprobs or [])[done:len(c.token_ids)]]
                    first = index not in offsets
                    if self.body.echo and index not in sent_echo:
                        sent_echo.add(index)
                        text = self._prompt_text(i) + text
                        if self.logprobs is not None:
                            lps = self._prompt_pairs(out) + lps
                    generated[index] = len(c.token_ids)
                    new_ids = self.token_ids and len(c.token_ids) > done  # ids of text not complete yet
                    if not text and not c.finish_reason and not lps and not new_ids:
                        continue
                    logprobs = None
                    if self.logprobs is not None:
                        logprobs = self._completion_logprobs(lps, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(text)
                    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason,
                              "stop_reason": c.stop_reason}
                    if self.token_ids:
                        choice["token_ids"] = list(c.token_ids[done:])
                        if first:
                            choice["prompt_token_ids"] = list(out.prompt_token_ids)
                    usage = (self._usage(prompt_tokens, sum(generated.values()), sum(cached.values()))
                             if continuous else None)
                    yield self._chunk("text_completion", [choice], usage)
        finally:
            for s in self.streams:
                s.close()
        if include_usage:
            yield self._chunk("text_completion", [],
                              self._usage(prompt_tokens, sum(generated.values()), sum(cached.values())))

    async def stream_chat(self) -> AsyncIterator[dict[str, Any]]:
        include_usage, continuous = self._stream_opts()
        prompt_tokens = len(self.prompts[0][1])
        generated: dict[int, int] = {}
        cached = 0
        for index in range(self.n):
            first = {"role": "assistant", "content": self._echo_prefix()}
            if self.parsing is not None and not first["content"]:  # content may never come (tool calls only)
                del first["content"]
            chunk = self._chunk("chat.completion.chunk", [{"index": index, "delta": first, "logprobs": None,
                                                           "finish_reason": None}],
                                self._usage(prompt_tokens, 0) if continuous else None)
            if self.token_ids and index == 0:  # vLLM's: the prompt's ids in the first chunk
                chunk["prompt_token_ids"] = list(self.prompts[0][1])
            yield chunk
        parsers = {index: self.parsing.choice() if self.parsing else None for index in range(self.n)}
        num_calls: dict[int, int] = {}
        try:
            async for _, out in self._merged():
                cached = out.metrics.num_cached_tokens
                for c in out.outputs:
                    done = generated.get(c.index, 0)
                    lps = list((c.logprobs or [])[done:len(c.token_ids)]) if self.logprobs is not None else []
                    generated[c.index] = len(c.token_ids)
                    new_ids = self.token_ids and len(c.token_ids) > done
                    deltas = self._chat_deltas(parsers[c.index], c, num_calls.get(c.index, 0))
                    num_calls[c.index] = num_calls.get(c.index, 0) + sum(1 for d in deltas if "id" in
                                                                          (d.get("tool_calls") or [{}])[0])
                    if not deltas and not c.finish_reason and not lps and not new_ids:
                        continue
                    finish = c.finish_reason
                    if finish == "stop" and num_calls[c.index]:
                        finish = "tool_calls"
                    usage = self._usage(prompt_tokens, sum(generated.values()), cached) if continuous else None
                    for k, delta in enumerate(deltas or [{}]):
                        last = k == max(len(deltas), 1) - 1
                        choice = {"index": c.index, "delta": delta,
                                  "logprobs": self._chat_logprobs(lps) if self.logprobs is not None and k == 0 else None,
                                  "finish_reason": finish if last else None, "stop_reason": c.stop_reason if last else None}
                        if self.token_ids and k == 0:
                            choice["token_ids"] = list(c.token_ids[done:])
                        yield self._chunk("chat.completion.chunk", [choice], usage)
        finally:
            for s in self.streams:
                s.close()
        if include_usage:
            yield self._chunk("chat.completion.chunk", [], self._usage(prompt_tokens, sum(generated.values()), cached))


def _with_transfer_params(response: dict[str, Any], outs: list[RequestOutput]) -> dict[str, Any]:
    """A prefill instance's answer carries the decode instance's kv_transfer_params at the top level."""
    params = [o.kv_transfer_params for o in outs if o.kv_transfer_params is not None]
    if params:
        response["kv_transfer_params"] = params[0]
    return response
