"""Scheduler admission and finishing, at their exact boundaries (hand-derived; written against the
survivors of the first scheduler/ mutation run, tests/MUTATION.md)."""
from __future__ import annotations

import pytest

from heterollm.config import load_config
from heterollm.kv_cache import KVCacheManager
from heterollm.sampling import SamplingParams
from heterollm.scheduler import Scheduler
from heterollm.scheduler.request import Request, RequestRejected, RequestStatus


def make(max_model_len=64, **flags):
    cfg = load_config([], overrides=flags).config
    return Scheduler(cfg.scheduler, KVCacheManager(64, 4), max_model_len)


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=4))


def rejected(s: Scheduler, r: Request) -> RequestRejected:
    with pytest.raises(RequestRejected) as info:
        s.add(r)
    assert s.requests.get(r.request_id) is not r and all(w is not r for w in s.waiting)  # nothing half-admitted
    return info.value


def test_an_empty_prompt_is_refused_naming_the_prompt():
    err = rejected(make(), req("a", 0))
    assert (err.field, err.status, str(err)) == ("prompt", 400, "the prompt is empty")


def test_the_context_length_boundary():
    """A prompt of max_model_len - 1 tokens leaves room for one generated token; max_model_len does not."""
    s = make(max_model_len=16)
    s.add(req("fits", 15))
    err = rejected(s, req("full", 16))
    assert (err.field, err.status) == ("prompt", 400)
    assert str(err) == ("the prompt has 16 tokens, but the model's context length (max_model_len) is 16; "
                        "shorten it")


def test_without_chunked_prefill_a_prompt_must_fit_one_step():
    s = make(max_model_len=512, enable_chunked_prefill=False, max_tokens_per_batch=20)
    s.add(req("fits", 20))
    err = rejected(s, req("long", 21))
    assert (err.field, err.status) == ("prompt", 400)
    assert str(err) == "the prompt has 21 tokens, more than max_tokens_per_batch=20 with chunked prefill disabled"
    make(max_model_len=512, max_tokens_per_batch=20).add(req("chunked", 21))  # chunked prefill takes it


def test_a_full_queue_is_a_429_at_exactly_request_queue_size():
    s = make(request_queue_size=2)
    s.add(req("a", 3))
    s.add(req("b", 3))
    err = rejected(s, req("c", 3))
    assert (err.field, err.status) == ("request", 429)
    assert str(err) == "the request queue is full (request_queue_size=2); retry later"


def test_a_request_id_in_use_is_refused():
    s = make()
    s.add(req("a", 3))
    err = rejected(s, req("a", 5))
    assert (err.field, err.status, str(err)) == ("request_id", 400, "request id 'a' is already in use")
    assert len(s.waiting) == 1 and s.requests["a"].num_prompt_tokens == 3


def test_finish_takes_a_request_out_of_whichever_queue_holds_it():
    s = make()
    for rid in ("run", "wait"):
        s.add(req(rid, 3))
    running = s.requests["run"]
    s.waiting.remove(running)
    s.running.append(running)
    running.status = RequestStatus.RUNNING
    s.finish("run", "abort")
    assert running not in s.running and running.status is RequestStatus.FINISHED
    assert running.finish_reason == "abort"
    waiting = s.requests["wait"]
    waiting.finish_reason = "stop"  # a reason already decided is kept
    s.finish("wait", "abort")
    assert waiting not in s.waiting and waiting.finish_reason == "stop" and not s.has_unfinished()
    s.finish("nosuch", "abort")  # unknown ids are ignored
