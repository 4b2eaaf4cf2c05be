"""vLLM's `use_beam_search` over HTTP: beam width `n`, `length_penalty`; the search of
heterollm.engine.beam_search, each round's one-token requests admitted and collected like any other
request's (so they batch with the rest of the traffic, and a client that leaves aborts them).

Fields beam search would silently ignore are refused with a 400 naming them (vLLM ignores most of
them). As in vLLM, /v1/completions refuses `stream: true` with beam search; /v1/chat/completions
streams the finished answer (the role chunk, then each choice's whole text in one chunk)."""
from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

from heterollm.engine.beam_search import (BeamSearch, BeamSearchParams, chosen_logprobs, run_beam_search_async,
                                          to_request_output)
from heterollm.engine.outputs import RequestOutput
from heterollm.entrypoints.openai.protocol import BadRequest
from heterollm.interfaces import TokenLogprobs
from heterollm.sampling.params import SamplingParamsError

_NEUTRAL: dict[str, tuple[Any, ...]] = {
    # field -> the values that ask for nothing beam search would ignore (compared type-exactly)
    "temperature": (None, 0, 0.0), "top_p": (None, 1, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0),
    "stop": (None, "", []), "stop_token_ids": (None, []), "min_tokens": (0,),
    "logprobs": (None, False), "prompt_logprobs": (None,),
    "logit_bias": (None, {}), "bad_words": (None, []), "allowed_token_ids": (None,), "truncate_prompt_tokens": (None,),
    "response_format": (None, {"type": "text"}), "structured_outputs": (None,), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
}
_REASONS = {
    "temperature": "beam search ranks by the model's log-probabilities and samples nothing; leave it out or send 0",
    "logprobs": "beam search returns no per-token logprobs",
    "stream": "streaming is not supported with beam search on /v1/completions (as in vLLM); chat streams the "
              "finished answer",
}


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    return any(type(value) is type(v) and value == v for v in neutral)


def beam_search_params(body: Any, max_tokens: int) -> BeamSearchParams:
    """The request's BeamSearchParams (width n); a field beam search cannot honour is a BadRequest
    naming it. Fields a request model lacks are skipped."""
    is_chat = "messages" in type(body).model_fields
    checks = dict(_NEUTRAL) if is_chat else {**_NEUTRAL, "stream": (False,)}
    for name, neutral in checks.items():
        value = getattr(body, name, None)
        if not _neutral(value, neutral):
            reason = _REASONS.get(name, "beam search does not apply it")
            raise BadRequest(f"{name} is not supported with use_beam_search: {reason}", name)
    try:
        return BeamSearchParams(beam_width=body.n, max_tokens=max_tokens, ignore_eos=body.ignore_eos,
                                length_penalty=body.length_penalty,
                                include_stop_str_in_output=body.include_stop_str_in_output)
    except SamplingParamsError as exc:
        name = "n" if exc.field == "beam_width" else exc.field
        raise BadRequest(f"{name} (with use_beam_search): {str(exc).split(': ', 1)[1]}", name) from None


async def run_beam_search_request(server: Any, request: Any, body: Any, prompts: list[tuple[str | None, list[int]]],
                                  max_tokens: int, request_id: str) -> list[RequestOutput]:
    """Run the search for every prompt of the request (their beams batched together each round); per
    prompt a finished RequestOutput whose choices are its beams, best first."""
    params = beam_search_params(body, max_tokens)
    search = BeamSearch([ids for _, ids in prompts], params, server.engine.eos_token_ids)
    step = params.step_params()
    rounds = itertools.count()

    async def run_round(token_id_lists: list[list[int]]) -> list[TokenLogprobs]:
        round_id = f"{request_id}-beam{next(rounds)}"
        streams = await server._admit([(None, ids) for ids in token_id_lists], step, round_id, body)
        return [chosen_logprobs(out) for out in await server._collect(request, streams)]

    await run_beam_search_async(search, run_round)
    tokenizer = server.engine.tokenizer
    results = search.outputs(lambda ids: tokenizer.decode(ids, skip_special_tokens=body.skip_special_tokens))
    return [to_request_output(request_id, text, result) for (text, _), result in zip(prompts, results)]


class FinishedStream:
    """A RequestStream look-alike over one finished output: what ResponseBuilder streams from."""

    def __init__(self, output: RequestOutput) -> None:
        self.output = output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        yield self.output

    def close(self) -> None:
        """Nothing runs any more: the search has finished."""
