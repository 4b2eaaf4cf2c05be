"""Issue 20's rule: every field of OpenAI's request schemas (read from the installed `openai` client, so
a newer client surfaces its new fields here) and of vLLM's (tests/data/vllm_request_fields.json), on
each route, is exactly one of: exercised by the tests named in EXERCISED (each must exist and mention
the field), refused (heterollm.entrypoints.openai.fields.REFUSED: sent to a live server, a 400 naming
the field and saying why; its neutral values pass), or in progress (fields.IN_PROGRESS, reported as
skipped until those fields land). A name in neither schema is ignored with a warning."""
from __future__ import annotations

import ast
import importlib.util
import logging
import re
from functools import cache
from pathlib import Path

import httpx
import pytest

from conftest import MODEL
from heterollm.entrypoints.openai.fields import IN_PROGRESS, REFUSED, ROUTES, works

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent


def _gen():
    spec = importlib.util.spec_from_file_location("gen_requests_doc", ROOT / "scripts" / "gen_requests_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SCHEMA = {route: _gen().schema_fields(route) for route in ROUTES}
"""route -> field -> the schemas that have it (OpenAI's from the installed client, vLLM's from the data file)."""

_F = "server/test_request_fields.py::"
_SAMPLING = _F + "test_sampling_fields_reach_the_engine"
_SHARED = {  # the same tests cover both routes
    "model": [_F + "test_model_is_the_served_name_or_404"],
    "n": [_SAMPLING, "server/test_openai_api.py::test_n_choices_seeded"],
    "temperature": [_SAMPLING], "top_p": [_SAMPLING], "top_k": [_SAMPLING], "min_p": [_SAMPLING],
    "presence_penalty": [_SAMPLING], "frequency_penalty": [_SAMPLING], "repetition_penalty": [_SAMPLING],
    "seed": [_SAMPLING, "server/test_openai_api.py::test_n_choices_seeded"],
    "stop": [_SAMPLING], "stop_token_ids": [_SAMPLING], "include_stop_str_in_output": [_SAMPLING],
    "ignore_eos": [_SAMPLING], "skip_special_tokens": [_SAMPLING], "max_tokens": [_SAMPLING],
    "user": [_F + "test_end_user_ids_are_accepted_and_change_nothing"],
    "priority": [_F + "test_priority_reaches_the_scheduler"],
    "request_id": [_F + "test_request_id_names_the_response_and_the_request"],
    "add_special_tokens": [_F + "test_add_special_tokens_reaches_the_tokenizer"],
    "logit_bias": ["server/test_sampling_fields_api.py::test_logit_bias_on_both_routes"],
    "allowed_token_ids": ["server/test_sampling_fields_api.py::test_allowed_token_ids_on_both_routes"],
    "min_tokens": ["server/test_sampling_fields_api.py::test_min_tokens_masks_eos_on_both_routes"],
    "truncate_prompt_tokens": ["server/test_sampling_fields_api.py::test_truncate_prompt_tokens_on_both_routes"],
    "response_format": ["server/test_structured_api.py::test_streamed_text_equals_the_whole_answer"],
    "kv_transfer_params": ["server/test_kv_transfer_api.py::test_kv_transfer_params_prefill_then_decode_streamed_or_not",
                           "server/test_kv_transfer_api.py::test_refusals_name_the_field"],
}
EXERCISED: dict[str, dict[str, list[str]]] = {
    # route -> field -> tests ("file under tests/::function") that exercise it on that route
    "completions": {
        **_SHARED,
        "prompt": ["server/test_openai_api.py::test_completion_token_prompts_and_batches"],
        "stop": [_SAMPLING, "server/test_openai_api.py::test_stop_strings_never_leak"],
        "max_tokens": [_SAMPLING, "server/test_openai_api.py::test_completion_matches_engine_and_usage"],
        "echo": ["server/test_openai_api.py::test_completion_logprobs_and_echo"],
        "logprobs": ["server/test_openai_api.py::test_completion_logprobs_and_echo"],
        "stream": ["server/test_openai_api.py::test_n_choices_seeded"],
        "stream_options": ["server/test_openai_api.py::test_usage_counts_equal_the_tokens"],
        "priority": [*_SHARED["priority"], "server/test_scheduling.py::test_priority_and_deadline_fields"],
        "return_tokens_as_token_ids": [_F + "test_return_tokens_as_token_ids_completions"],
        "return_token_ids": [_F + "test_return_token_ids_completions"],
        "use_beam_search": ["server/test_beam_search_api.py::test_completions_choices_are_the_beams_best_first"],
        "length_penalty": ["server/test_beam_search_api.py::test_length_penalty_and_eos_over_http"],
        "prompt_logprobs": ["server/test_prompt_logprobs_api.py::test_completions_carry_them_per_choice"],
        "best_of": ["server/test_sampling_fields_api.py::test_best_of_returns_the_highest_cumulative_logprob"],
        "structured_outputs": ["server/test_structured_api.py::test_openai_client_extra_body_spellings",
                               "server/test_structured_api.py::test_logprobs_are_the_constrained_distribution"],
        "response_format": [*_SHARED["response_format"],
                            "server/test_structured_api.py::test_openai_client_extra_body_spellings"],
    },
    "chat": {
        **_SHARED,
        "messages": ["server/test_openai_api.py::test_chat_and_streaming_chat_agree",
                     "server/test_multimodal_api.py::test_http_url_with_launch_and_request_headers"],
        "mm_processor_kwargs": ["server/test_multimodal_api.py::test_mm_processor_kwargs_reach_the_image_processor"],
        "max_completion_tokens": [_SAMPLING],
        "logprobs": ["server/test_openai_api.py::test_chat_logprobs"],
        "top_logprobs": ["server/test_openai_api.py::test_chat_logprobs"],
        "stream": ["server/test_openai_api.py::test_chat_and_streaming_chat_agree"],
        "stream_options": ["server/test_openai_api.py::test_chat_and_streaming_chat_agree"],
        "echo": ["server/test_readme_claims.py::test_chat_echo_prepends_the_final_assistant_content"],
        "add_generation_prompt": ["server/test_readme_claims.py::test_continue_final_message_continues_the_assistant_turn"],
        "continue_final_message": [
            "server/test_readme_claims.py::test_continue_final_message_continues_the_assistant_turn"],
        "chat_template": ["server/test_readme_claims.py::test_chat_template_kwargs_reach_the_template"],
        "chat_template_kwargs": ["server/test_readme_claims.py::test_chat_template_kwargs_reach_the_template",
                                 "server/test_tools_api.py::test_enable_thinking_reaches_the_template"],
        "tools": ["server/test_tools_api.py::test_history_with_tool_calls_and_tool_results_reaches_the_template",
                  "server/test_tools_api.py::test_a_server_without_the_flags_names_them",
                  "server/test_tools_api.py::test_bad_tool_input_is_a_400_naming_the_field"],
        "tool_choice": ["server/test_tools_api.py::test_forced_calls_streamed_and_not",
                        "server/test_smollm2_tools.py::test_every_answer_is_a_valid_call"],
        "parallel_tool_calls": ["server/test_tools_api.py::test_parallel_tool_calls_false_gives_one_call"],
        "include_reasoning": ["server/test_tools_api.py::test_reasoning_content_and_include_reasoning"],
        "return_tokens_as_token_ids": [_F + "test_return_tokens_as_token_ids_chat"],
        "return_token_ids": [_F + "test_return_token_ids_chat"],
        "reasoning_effort": [_F + "test_template_variables_reach_the_template"],
        "documents": [_F + "test_template_variables_reach_the_template"],
        "safety_identifier": [_F + "test_end_user_ids_are_accepted_and_change_nothing"],
        "prompt_cache_key": [_F + "test_prompt_cache_key_pins_a_replica"],
        "use_beam_search": ["server/test_beam_search_api.py::test_chat_choices_and_its_stream_are_the_beams"],
        "length_penalty": ["server/test_beam_search_api.py::test_length_penalty_and_eos_over_http"],
        "prompt_logprobs": ["server/test_prompt_logprobs_api.py::test_chat_carries_them_at_the_top_level"],
        "bad_words": ["server/test_sampling_fields_api.py::test_bad_words_on_both_routes"],
        "structured_outputs": ["server/test_structured_api.py::test_openai_client_extra_body_spellings"],
        "response_format": [*_SHARED["response_format"],
                            "server/test_structured_api.py::test_openai_client_response_format_json_schema"],
    },
}

PLAUSIBLE = {
    # a value a client could well send for each refused field
    "spaces_between_special_tokens": False,
    "prompt_embeds": ["AAAAAA=="],
    "logits_processors": ["my_package.MyLogitsProcessor"],
    "cache_salt": "kH3b9c0dZq1s8fV2nLx7uTq4YpR6wAe5jMiNoP0Gk1E",
    "vllm_xargs": {"my_extension_arg": 1},
    "max_repetition_pattern_size": 8,
    "min_repetition_pattern_size": 2,
    "repetition_min_count": 3,
    "suffix": " and they all lived happily.",
    "functions": [{"name": "get_weather", "parameters": {"type": "object"}}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "Hello there"},
    "web_search_options": {"search_context_size": "low"},
    "store": True,
    "metadata": {"project": "demo"},
    "service_tier": "flex",
    "verbosity": "low",
    "moderation": {"model": "omni-moderation-latest"},
    "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
    "prompt_cache_retention": "24h",
}

BASE = {"completions": ("/v1/completions", {"prompt": "Once upon a time"}),
        "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})}


def statuses(route: str, name: str) -> list[str]:
    rule = REFUSED.get(name)
    return [s for s, hit in (("exercised", name in EXERCISED[route]),
                             ("refused", rule is not None and route in rule.routes),
                             ("in progress", name in IN_PROGRESS)) if hit]


def _refused(route: str) -> list[str]:
    return [n for n in SCHEMA[route] if statuses(route, n) == ["refused"]]


@pytest.mark.parametrize("route", ROUTES)
def test_every_schema_field_is_exercised_refused_or_in_progress(route):
    fields = SCHEMA[route]
    assert len(fields) > 40  # both schemas were read
    none = sorted(n for n in fields if not statuses(route, n))
    several = sorted(f"{n} ({' + '.join(statuses(route, n))})" for n in fields if len(statuses(route, n)) > 1)
    assert not none, f"{route}: fields neither exercised nor refused nor in progress: {none}"
    assert not several, f"{route}: fields with more than one status: {several}"


@pytest.mark.parametrize("route", ROUTES)
def test_tables_hold_only_schema_fields_and_agree_with_the_doc(route):
    fields = SCHEMA[route]
    assert sorted(set(EXERCISED[route]) - set(fields)) == []
    assert sorted(n for n, r in REFUSED.items() if route in r.routes and n not in fields) == []
    # docs/requests.md says what a field does exactly where a test exercises it
    assert sorted(n for n in fields if (works(n, route) is not None) != (n in EXERCISED[route])) == []


@cache
def _test_sources(rel: str) -> dict[str, str]:
    """function name -> its source, decorators included, of a test file under tests/."""
    src = (TESTS / rel).read_text(encoding="utf-8")
    lines = src.splitlines()
    out = {}
    for node in ast.parse(src).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[node.name] = "\n".join(lines[start - 1:node.end_lineno])
    return out


@pytest.mark.parametrize("route, name", [(r, n) for r in ROUTES for n in sorted(EXERCISED[r])])
def test_exercised_fields_name_tests_that_exist_and_use_them(route, name):
    for ref in EXERCISED[route][name]:
        rel, func = ref.split("::")
        assert (TESTS / rel).is_file(), f"{ref}: no such file"
        source = _test_sources(rel).get(func)
        assert source is not None, f"{ref}: no such test"
        assert re.search(rf"[\"']{name}[\"']|\b{name}=", source), f"{ref} does not mention {name}"


@pytest.fixture(scope="module")
def http(srv):
    with httpx.Client(base_url=srv.url, timeout=60) as c:
        yield c


@pytest.mark.parametrize("route, name", [(r, n) for r in ROUTES for n in _refused(r)])
def test_refused_fields_are_a_400_naming_them_and_why(http, route, name):
    assert name in PLAUSIBLE, f"give {name} a plausible value in PLAUSIBLE"
    path, base = BASE[route]
    r = http.post(path, json={"model": MODEL, "max_tokens": 1, **base, name: PLAUSIBLE[name]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err == {"message": REFUSED[name].message(name), "type": "invalid_request_error", "param": name,
                   "code": 400}
    assert err["message"].startswith(f"{name} is not supported: ") and len(REFUSED[name].reason) > 20
    for neutral in REFUSED[name].neutral:  # asking for nothing passes
        r = http.post(path, json={"model": MODEL, "max_tokens": 1, **base, name: neutral})
        assert r.status_code == 200, (neutral, r.text)


@pytest.mark.parametrize("route", ROUTES)
def test_names_in_neither_schema_are_ignored_with_a_warning(http, caplog, route):
    path, base = BASE[route]
    other = "store" if route == "completions" else "suffix"  # the other route's field: in neither schema here
    assert other not in SCHEMA[route]
    with caplog.at_level(logging.WARNING, logger="heterollm.server"):
        r = http.post(path, json={"model": MODEL, "max_tokens": 1, **base, "frobnicate": 1, other: True})
    assert r.status_code == 200, r.text
    assert f"ignoring unknown request fields: frobnicate, {other}" in caplog.text


def test_no_field_is_left_in_progress():
    """Every field of issue 20 has landed: none may sit in fields.IN_PROGRESS, neither exercised nor refused."""
    waiting = sorted({n for r in ROUTES for n in SCHEMA[r] if statuses(r, n) == ["in progress"]})
    assert not waiting, f"in progress, neither exercised nor refused: {', '.join(waiting)}"


@pytest.mark.parametrize("route, name, value, message", [
    ("completions", "spaces_between_special_tokens", False, "spaces_between_special_tokens is not supported: the "
     "detokenizer decodes with the tokenizer's own spacing; only true is accepted"),
    ("completions", "cache_salt", "s", "cache_salt is not supported: the prefix cache's hash chain takes no "
     "per-request key, so it cannot be salted"),
    ("chat", "service_tier", "flex", "service_tier is not supported: there is one service tier (`priority` orders "
     "requests); only \"auto\" or \"default\" is accepted"),
])
def test_a_refusal_says_why_and_which_values_pass_word_for_word(http, route, name, value, message):
    """Written out by hand: no accepted value but null (nothing added), one, two (joined by "or")."""
    path, base = BASE[route]
    r = http.post(path, json={"model": MODEL, "max_tokens": 1, **base, name: value})
    assert r.status_code == 400 and r.json()["error"]["message"] == message, r.text
