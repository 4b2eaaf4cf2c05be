"""The rule for request fields (issue 20): every field of OpenAI's and vLLM's completion and chat
request schemas either works or is refused with a 400 naming it and saying why; only names in
neither schema are ignored with a warning (as vLLM does).

`REFUSED` is the table the request models apply (`refuse_fields`); `WORKS` says in one line what
each working field does; `IN_PROGRESS` names the fields being built. docs/requests.md is generated
from them (scripts/gen_requests_doc.py), and tests/server/test_request_schema_rule.py holds every
schema field to exactly one of them."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

ROUTES = ("completions", "chat")


@dataclass(frozen=True)
class Refused:
    """A schema field the server cannot honour: any value but the neutral ones is a 400."""

    reason: str
    """Why it is refused (the end of the error message)."""
    neutral: tuple[Any, ...] = (None,)
    """Values that ask for nothing (the field's off value or default): accepted, and they change nothing."""
    routes: tuple[str, ...] = ROUTES

    def accepted(self) -> list[Any]:
        """The neutral values a client may send besides null."""
        return [v for v in self.neutral if v is not None]

    def message(self, name: str) -> str:
        ok = " or ".join(json.dumps(v) for v in self.accepted())
        return f"{name} is not supported: {self.reason}" + (f"; only {ok} is accepted" if ok else "")


_OLD_TOOLS = "the deprecated function-calling form is not accepted"
_NO_STORE = "heterollm keeps no record of a request once it is answered"
_REPETITION = "stopping on repeated token patterns is not implemented"

REFUSED: dict[str, Refused] = {
    # -- both routes ------------------------------------------------------------------------
    "spaces_between_special_tokens": Refused(
        "the detokenizer decodes with the tokenizer's own spacing", (None, True)),
    "logits_processors": Refused("loading Python logits processors named by a request is not implemented", (None, [])),
    "cache_salt": Refused("the prefix cache's hash chain takes no per-request key, so it cannot be salted"),
    "vllm_xargs": Refused("no extension reads custom request arguments", (None, {})),
    "max_repetition_pattern_size": Refused(_REPETITION, (None, 0)),
    "min_repetition_pattern_size": Refused(_REPETITION, (None, 0)),
    "repetition_min_count": Refused(_REPETITION, (None, 0)),
    # -- completions ------------------------------------------------------------------------
    "prompt_embeds": Refused("prompts are token ids or text; embeddings cannot be fed to the model", (None, []),
                             ("completions",)),
    "suffix": Refused("fill-in-the-middle needs the model's own infilling prompt format, which is not "
                      "implemented", (None, ""), ("completions",)),
    # -- chat -------------------------------------------------------------------------------
    "functions": Refused(_OLD_TOOLS + "; send `tools` (functions is their deprecated form)", (None, []), ("chat",)),
    "function_call": Refused(_OLD_TOOLS + "; send `tool_choice` (function_call is its deprecated form)",
                             (None, "none"), ("chat",)),
    "audio": Refused("the models served generate text only", (None,), ("chat",)),
    "modalities": Refused("the models served generate text only", (None, ["text"]),
                          ("chat",)),
    "prediction": Refused("predicted outputs (speculating on a given text) are not implemented", (None,), ("chat",)),
    "web_search_options": Refused("there is no web search", (None,), ("chat",)),
    "store": Refused(_NO_STORE, (None, False), ("chat",)),
    "metadata": Refused("metadata tags a stored completion, and " + _NO_STORE, (None, {}), ("chat",)),
    "service_tier": Refused("there is one service tier (`priority` orders requests)", (None, "auto", "default"), ("chat",)),
    "verbosity": Refused("nothing steers the answer's length but max_completion_tokens", (None, "medium"), ("chat",)),
    "moderation": Refused("no moderation model runs on requests or answers", (None,), ("chat",)),
    "prompt_cache_options": Refused("the prefix cache matches prefixes on its own: it has no explicit breakpoints "
                                    "or lifetimes", (None,), ("chat",)),
    "prompt_cache_retention": Refused("cached prefixes live in memory until evicted",
                                      (None, "in_memory"), ("chat",)),
}


def refuse_fields(values: dict[str, Any], route: str) -> tuple[str, str] | None:
    """The first field of `values` (name -> value, as sent) that `route` refuses: (name, message)."""
    for name, value in values.items():
        rule = REFUSED.get(name)
        if rule is not None and route in rule.routes and not _neutral(value, rule.neutral):
            return name, rule.message(name)
    return None


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    # type-exact: 0 is not false, 1 is not true
    return any(type(value) is type(v) and value == v for v in neutral)


IN_PROGRESS: frozenset[str] = frozenset()
"""Fields being built; each moves into WORKS with its tests when it lands."""

WORKS: dict[str, dict[str, str]] = {
    # name -> {route (or "both"): what it does and its limits}
    "model": {"both": "must be the served model name (`--served_model_name`) or left out; else 404"},
    "prompt": {"completions": "a string, a list of strings, a list of token ids, or a list of such lists (one "
                              "choice each, index = prompt x n + i)"},
    "messages": {"chat": "roles system, developer, user, assistant, tool; content a string or a list of "
                         "{\"type\": \"text\"} parts and, in user messages on a vision-language model, "
                         "{\"type\": \"image_url\"} parts (a data: or http(s) URL; `detail` changes nothing); "
                         "audio and video parts: 400; rendered with the chat template"},
    "n": {"both": "1-128 choices (all prompts together)"},
    "temperature": {"both": "0 is greedy; left out: the model's generation_config, else 1"},
    "top_p": {"both": "nucleus sampling; left out: the model's generation_config"},
    "top_k": {"both": "vLLM's; left out: the model's generation_config"},
    "min_p": {"both": "vLLM's"},
    "seed": {"both": "a per-request generator: the same seed gives the same answer"},
    "stop": {"both": "a string or a list; the matched one is the choice's stop_reason"},
    "stop_token_ids": {"both": "vLLM's; the matched id is the choice's stop_reason"},
    "presence_penalty": {"both": "OpenAI's additive penalty on tokens already generated"},
    "frequency_penalty": {"both": "OpenAI's penalty per occurrence of a generated token"},
    "repetition_penalty": {"both": "vLLM's multiplicative penalty on prompt and generated tokens"},
    "ignore_eos": {"both": "vLLM's: keep generating past the end-of-sequence token"},
    "skip_special_tokens": {"both": "vLLM's: leave special tokens out of the text (default true)"},
    "include_stop_str_in_output": {"both": "vLLM's: keep the matched stop string in the text"},
    "stream": {"both": "Server-Sent Events, then `data: [DONE]`"},
    "stream_options": {"both": "include_usage (a last chunk with the usage), continuous_usage_stats (vLLM's: "
                               "usage in every chunk); only with stream=true"},
    "user": {"both": "an opaque end-user id: accepted, and by definition it changes nothing in the answer"},
    "priority": {"both": "vLLM's: lower is served first (needs --priority_strategy=priority)"},
    "max_tokens": {"completions": "default 16 (clamped to the context left); prompt + max_tokens must fit "
                                  "max_model_len",
                   "chat": "the older name of max_completion_tokens"},
    "max_completion_tokens": {"chat": "default: the rest of the context"},
    "use_beam_search": {"both": "vLLM's: beam search of width n (at most 10), choices best first; 400 for the fields "
                                "it cannot honour (temperature > 0, logprobs, sampling knobs, stop, ...); completions "
                                "refuse stream=true, chat streams the finished answer (as vLLM)"},
    "length_penalty": {"both": "vLLM's: with use_beam_search, finished beams rank by cum_logprob / "
                               "len ** length_penalty (len counts the prompt, not a final EOS); else ignored"},
    "logit_bias": {"both": "OpenAI's: {\"<token id>\": bias} added to the logits before sampling, each bias "
                           "clamped to [-100, 100] (as vLLM); an id outside the vocabulary: 400. Logprobs stay the "
                           "model's own"},
    "bad_words": {"both": "vLLM's: words never generated; each is tokenized as-is and with a leading space; a one-token "
                          "word's token is banned, a longer word's last token right after its other tokens"},
    "allowed_token_ids": {"both": "vLLM's: only these tokens may be sampled (non-empty, in the vocabulary)"},
    "min_tokens": {"both": "vLLM's: EOS (unless ignore_eos) and stop_token_ids are masked until this many tokens "
                           "are out; stop strings are not checked before"},
    "truncate_prompt_tokens": {"both": "vLLM's: keep only the last k prompt tokens (-1: max_model_len; more than "
                                       "max_model_len: 400), before the context-length check"},
    "best_of": {"both": "sample best_of (n..128) sequences and return the n with the highest cumulative logprob "
                        "(vLLM v0); usage counts the returned ones; best_of > n with stream=true: 400"},
    "prompt_logprobs": {"completions": "vLLM's: 0-20; per choice, each prompt token's {token id: {logprob, rank, "
                                       "decoded_token}} (null for the first); not with stream=true unless 0",
                        "chat": "vLLM's: 0-20; at the top level of the response, as on completions"},
    "response_format": {"both": "structured output (needs --guided_decoding_backend auto or xgrammar, else 400 naming "
                                "it): {\"type\": \"json_schema\", \"json_schema\": {\"schema\", \"strict\"}}, "
                                "{\"type\": \"json_object\"}, vLLM's {\"type\": \"structural_tag\", ...}, or "
                                "\"text\"; a schema that does not compile: 400 with the compiler's reason"},
    "structured_outputs": {"both": "vLLM's: one of json, regex, choice, grammar (EBNF / GBNF), json_object, "
                                   "structural_tag, plus disable_any_whitespace; vLLM's older guided_json / "
                                   "guided_regex / guided_choice / guided_grammar spell the same; needs "
                                   "--guided_decoding_backend auto or xgrammar; a constraint that does not compile: "
                                   "400 naming structured_outputs.<kind>"},
    "logprobs": {"completions": "0-20: OpenAI's legacy object (tokens, token_logprobs, top_logprobs, text_offset)",
                 "chat": "true: each token's logprob, with top_logprobs alternatives"},
    "top_logprobs": {"chat": "0-20, needs logprobs=true"},
    "echo": {"completions": "the prompt is prepended to the text; with logprobs the prompt tokens get theirs "
                            "(null for the first)",
             "chat": "vLLM's: the content of a final assistant message is prepended to the answer"},
    "add_generation_prompt": {"chat": "vLLM's: end the rendered prompt with the assistant header (default true)"},
    "continue_final_message": {"chat": "vLLM's: the answer continues the final assistant message (needs "
                                       "add_generation_prompt=false)"},
    "chat_template": {"chat": "vLLM's: a Jinja template replacing the model's (or --chat_template) for this request"},
    "chat_template_kwargs": {"chat": "vLLM's: extra variables for the chat template (enable_thinking: with "
                                     "--reasoning_parser, the rendered prompt decides whether the answer starts in "
                                     "reasoning)"},
    "add_special_tokens": {"completions": "vLLM's: add the tokenizer's special tokens (BOS) to a text prompt "
                                          "(default true)",
                           "chat": "vLLM's: add the tokenizer's special tokens on top of the chat template's "
                                   "(default false)"},
    "request_id": {"both": "vLLM's: the response id becomes cmpl-<request_id> / chatcmpl-<request_id> and the "
                           "engine tracks the request by it; one still in flight with the same id: 400"},
    "return_tokens_as_token_ids": {"both": "vLLM's: with logprobs, each token is written \"token_id:<id>\" "
                                           "(for tokens that are not valid text on their own)"},
    "return_token_ids": {"both": "vLLM's: each choice carries its token_ids and the response its "
                                 "prompt_token_ids (in a stream: prompt_token_ids in each choice's first chunk, "
                                 "each chunk's new token_ids)"},
    "reasoning_effort": {"chat": "passed to the chat template as `reasoning_effort` (as vLLM does); a 400 when the "
                                 "template does not read it, since it would change nothing"},
    "documents": {"chat": "vLLM's: passed to the chat template as `documents` (retrieval-augmented templates); a "
                          "400 when the template does not read it"},
    "safety_identifier": {"chat": "an opaque end-user id (OpenAI's successor of user): accepted, and by definition "
                                  "it changes nothing in the answer"},
    "tools": {"chat": "function tools; with tool_choice auto (the default) the answer's calls are parsed by "
                      "--tool_call_parser (400 without it) into message.tool_calls, finish_reason \"tool_calls\"; "
                      "tools are passed to the chat template; a malformed schema: 400 naming it"},
    "tool_choice": {"chat": "auto, none (tools stay in the prompt, nothing is parsed), required or a named function: "
                            "those two decode under structured output (needs --guided_decoding_backend auto, else "
                            "400), so the call is valid JSON for its schema; a function not in tools: 400"},
    "parallel_tool_calls": {"chat": "false keeps only the first call (required is constrained to one)"},
    "mm_processor_kwargs": {"chat": "vLLM's: min_pixels / max_pixels (or image_min_pixels / image_max_pixels) for "
                                    "this request's images, over --mm_processor_kwargs; other keys, or any on a "
                                    "text-only model: 400"},
    "include_reasoning": {"chat": "vLLM's: with --reasoning_parser, false leaves reasoning_content out (without the "
                                  "parser false is a 400)"},
    "kv_transfer_params": {"both": "prefill/decode disaggregation (docs: README \"Disaggregated serving\"), set by "
                                   "`heterollm route`. PUSH: {\"do_remote_prefill\": true, \"reserve\": true} on a "
                                   "DECODE instance answers at once with a block reservation; that reservation on a "
                                   "PREFILL instance makes it write the prompt's KV into those blocks (a failed push: "
                                   "502 kv_transfer_failed) and answer a top-level kv_transfer_params, which on the "
                                   "DECODE instance takes the blocks over. PULL: {\"do_remote_decode\": true} on a "
                                   "PREFILL instance answers with a top-level kv_transfer_params for the DECODE "
                                   "instance and keeps the KV blocks until POST /v1/kv_transfer/release; a DECODE "
                                   "instance takes that object and pulls the KV cache instead of computing the prompt "
                                   "(a failed pull: 502 kv_transfer_failed, or that error as the first event of a "
                                   "stream). One prompt only, not with use_beam_search; a value the instance cannot "
                                   "serve: 400 naming it"},
    "prompt_cache_key": {"chat": "with --dp_size > 1 replicas, requests with the same key go to the same replica, so "
                                 "they share its prefix cache; with one engine the prefix cache already matches every "
                                 "request's prefix (under attention data parallelism the engine sends a prompt to the "
                                 "DP rank caching its prefix), and the key changes nothing"},
}


def works(name: str, route: str) -> str | None:
    """What a working field does on `route`, or None."""
    entry = WORKS.get(name, {})
    return entry.get(route, entry.get("both"))
