"""Beam search on top of the engine, the way vLLM's serving layer does it.

Each round submits one one-token request per live beam (all prompts' beams together), asking for
the top `2 * beam_width` logprobs of the model's own distribution; every (beam, token) pair is a
candidate scored by its cumulative logprob. A candidate ending in EOS (unless `ignore_eos`) moves
to the finished list; of the others, the best `beam_width` by cumulative logprob live on. After
`max_tokens` rounds (or when no beam is left) the live beams join the finished ones, which are
ranked by `beam_search_score` (cumulative logprob / length ** length_penalty) and the best
`beam_width` returned. The prefix cache makes re-feeding a beam's prefix each round cheap.

The search itself (`BeamSearch`) knows no engine: a driver runs each round's requests, the
synchronous one for `LLM.beam_search` (`run_beam_search`), the asyncio one for the HTTP server
(`run_beam_search_async`).
"""
from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field

from heterollm.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from heterollm.interfaces import TokenLogprobs
from heterollm.sampling import SamplingParams
from heterollm.sampling.params import SamplingParamsError

MAX_BEAM_WIDTH = 10
"""Each round asks for 2 * beam_width logprobs, and a request may ask for at most 20."""


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams. A bad value raises SamplingParamsError (a ValueError) naming it."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    """Only 0: the search ranks by the model's own log-probabilities and draws nothing."""
    length_penalty: float = 1.0
    """Exponent of the length that divides a finished sequence's cumulative logprob when ranking."""
    include_stop_str_in_output: bool = False
    """Keep the EOS token that ended a sequence in its tokens (its text never shows it)."""

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise SamplingParamsError(name, f"{msg}, got {getattr(self, name)!r}")

        need(isinstance(self.beam_width, int) and 1 <= self.beam_width <= MAX_BEAM_WIDTH, "beam_width",
             f"must be an integer in [1, {MAX_BEAM_WIDTH}] (each round asks for 2 x beam_width logprobs, at most 20)")
        need(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1")
        need(self.temperature == 0, "temperature", "must be 0: beam search ranks by log-probabilities and samples "
                                                   "nothing")
        need(isinstance(self.length_penalty, (int, float)) and math.isfinite(self.length_penalty), "length_penalty",
             "must be a finite number")

    def step_params(self) -> SamplingParams:
        """What each round's one-token request asks of the engine."""
        return SamplingParams(max_tokens=1, temperature=0.0, logprobs=2 * self.beam_width, ignore_eos=True)


@dataclass
class BeamSearchSequence:
    """One sequence of a search, shaped like vLLM's: `tokens` holds the prompt and the generated
    tokens, `text` the whole sequence decoded (as vLLM's offline beam_search returns it)."""

    tokens: list[int]
    num_prompt_tokens: int
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    """One per generated token in `tokens`: its logprob and the round's top alternatives."""
    cum_logprob: float = 0.0
    """Sum of the generated tokens' logprobs, the EOS that ended the sequence included."""
    text: str | None = None
    output_text: str | None = None
    """The generated part alone, decoded (set, like `text`, when the search returns it)."""
    finish_reason: str | None = None
    """"stop" (EOS) or "length" (max_tokens)."""
    stop_reason: int | None = None
    """The EOS token id that ended the sequence."""

    @property
    def output_token_ids(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens:]


@dataclass
class BeamSearchOutput:
    """vLLM's BeamSearchOutput: the best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_ids: Collection[int],
                      length_penalty: float) -> float:
    """vLLM's get_beam_search_score: cum_logprob / len ** length_penalty, where len counts every token
    of the sequence (the prompt's included) except a final EOS."""
    length = len(tokens) - (1 if tokens and tokens[-1] in eos_token_ids else 0)
    return cum_logprob / (length ** length_penalty)


@dataclass
class _Candidate:
    cum_logprob: float
    beam: BeamSearchSequence
    step: TokenLogprobs


class _PromptSearch:
    """The live and finished beams of one prompt."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_ids: Collection[int]) -> None:
        self.params, self.eos_token_ids = params, eos_token_ids
        self.live = [BeamSearchSequence(list(prompt_token_ids), len(prompt_token_ids))]
        self.finished: list[BeamSearchSequence] = []

    def advance(self, steps: list[TokenLogprobs]) -> None:
        """`steps[i]`: the round's logprobs after live beam i. Finish EOS candidates, keep the best others."""
        candidates = []
        for beam, step in zip(self.live, steps):
            for rank, (token_id, logprob) in enumerate(step.top, start=1):
                chosen = TokenLogprobs(token_id, logprob, rank, step.top)
                candidate = _Candidate(beam.cum_logprob + logprob, beam, chosen)
                if token_id in self.eos_token_ids and not self.params.ignore_eos:
                    self.finished.append(self._finish(candidate))
                else:
                    candidates.append(candidate)
        candidates.sort(key=lambda c: c.cum_logprob, reverse=True)  # stable: ties keep beam, then rank, order
        self.live = [self._extend(c) for c in candidates[: self.params.beam_width]]

    @staticmethod
    def _extend(c: _Candidate) -> BeamSearchSequence:
        return BeamSearchSequence(c.beam.tokens + [c.step.token_id], c.beam.num_prompt_tokens,
                                  c.beam.logprobs + [c.step], c.cum_logprob)

    def _finish(self, c: _Candidate) -> BeamSearchSequence:
        keep = self.params.include_stop_str_in_output
        return BeamSearchSequence(c.beam.tokens + ([c.step.token_id] if keep else []), c.beam.num_prompt_tokens,
                                  c.beam.logprobs + ([c.step] if keep else []), c.cum_logprob,
                                  finish_reason="stop", stop_reason=c.step.token_id)

    def best(self) -> list[BeamSearchSequence]:
        """The best `beam_width` of the finished and the still-live beams (those end by length)."""
        for beam in self.live:
            beam.finish_reason = "length"
        done = self.finished + self.live
        self.live = []
        p = self.params
        done.sort(key=lambda s: beam_search_score(s.tokens, s.cum_logprob, self.eos_token_ids, p.length_penalty),
                  reverse=True)
        return done[: p.beam_width]


class BeamSearch:
    """The search over a batch of prompts, one round at a time. A driver loops: while not `done`,
    run a one-token request (`params.step_params()`) for each of `live_token_ids()` and hand the
    chosen logprobs of each back to `advance`; then `outputs` ranks and decodes."""

    def __init__(self, prompts: list[list[int]], params: BeamSearchParams, eos_token_ids: Collection[int]) -> None:
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.prompts = [_PromptSearch(ids, params, self.eos_token_ids) for ids in prompts]
        self.num_rounds = 0

    @property
    def done(self) -> bool:
        return self.num_rounds >= self.params.max_tokens or not any(p.live for p in self.prompts)

    def live_token_ids(self) -> list[list[int]]:
        """The tokens of every live beam, prompt by prompt: the next round's requests."""
        return [beam.tokens for p in self.prompts for beam in p.live]

    def advance(self, steps: list[TokenLogprobs]) -> None:
        """`steps`: the round's logprobs, one per `live_token_ids()` entry, in that order."""
        if len(steps) != sum(len(p.live) for p in self.prompts):
            raise ValueError(f"advance: {len(steps)} results for {sum(len(p.live) for p in self.prompts)} beams")
        start = 0
        for p in self.prompts:
            n = len(p.live)
            p.advance(steps[start:start + n])
            start += n
        self.num_rounds += 1

    def outputs(self, decode: Callable[[list[int]], str]) -> list[BeamSearchOutput]:
        """Per prompt, its best `beam_width` sequences, best first, with `text` and `output_text`
        decoded by `decode` (token ids -> text); the EOS that ended a sequence is never in its text."""
        results = []
        for p in self.prompts:
            best = p.best()
            for s in best:
                kept_eos = s.finish_reason == "stop" and self.params.include_stop_str_in_output
                shown = s.tokens[:-1] if kept_eos else s.tokens
                s.text = decode(shown)
                s.output_text = decode(shown[s.num_prompt_tokens:])
            results.append(BeamSearchOutput(best))
        return results


def run_beam_search(search: BeamSearch, run_round: Callable[[list[list[int]]], list[TokenLogprobs]]) -> None:
    """Drive `search` to its end; `run_round(token_id_lists)` runs one one-token request per list
    and returns each one's chosen-token logprobs (with its top alternatives), in order."""
    while not search.done:
        search.advance(run_round(search.live_token_ids()))


async def run_beam_search_async(search: BeamSearch,
                                run_round: Callable[[list[list[int]]], Awaitable[list[TokenLogprobs]]]) -> None:
    """`run_beam_search` for an asyncio engine."""
    while not search.done:
        search.advance(await run_round(search.live_token_ids()))


def chosen_logprobs(out: RequestOutput) -> TokenLogprobs:
    """A finished one-token request's logprobs (its token's, with the top alternatives); RuntimeError
    when it ended without a token (aborted)."""
    completion = out.outputs[0]
    if not completion.logprobs:
        raise RuntimeError(f"beam search: request {out.request_id} ended without a token "
                           f"(finish_reason={completion.finish_reason!r})")
    return completion.logprobs[0]


def to_request_output(request_id: str, prompt: str | None, result: BeamSearchOutput) -> RequestOutput:
    """A finished RequestOutput whose choices are the sequences, best first (index 0 the best):
    what the HTTP responses are built from."""
    first = result.sequences[0]
    num_prompt = first.num_prompt_tokens
    completions = [CompletionOutput(index=i, text=s.output_text or "", token_ids=s.output_token_ids,
                                    finish_reason=s.finish_reason, stop_reason=s.stop_reason,
                                    delta_text=s.output_text or "", delta_token_ids=s.output_token_ids)
                   for i, s in enumerate(result.sequences)]
    now = time.monotonic()
    metrics = RequestMetrics(arrival_time=now, finished_time=now, num_prompt_tokens=num_prompt,
                             num_generated_tokens=sum(len(s.output_token_ids) for s in result.sequences))
    return RequestOutput(request_id, prompt, first.tokens[:num_prompt], completions, True, metrics)
