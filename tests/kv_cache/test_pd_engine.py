"""Prefill/decode disaggregation, engine side (kv_cache/pd.py): a PREFILL engine keeps a prompt's
blocks and describes them; a DECODE engine pulls them over Mooncake's transfer engine (TCP, real)
and decodes with the same greedy tokens as one instance; blocks come back on both sides; a pull
from a dead peer ends only that request, with the reason; bad params are refused naming the field;
the PD flags' launch checks."""
from __future__ import annotations

import contextlib
import logging
import random
import re
import socket
import threading
from pathlib import Path

import pytest

from heterollm.config import load_config
from heterollm.config.checks import check_flag_combinations
from heterollm.scheduler.request import RequestRejected

from helpers import build_tiny_model

COMMON = dict(dtype="float32", block_size=8, num_gpu_blocks_override=40, max_model_len=128)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("pd") / "m", "llama")


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(1)
    return [[rng.randrange(100, 20000) for _ in range(n)] for n in (5, 16, 23, 39)]


def greedy(max_tokens=8):
    from heterollm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)


def drain(engine):
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


@pytest.fixture(scope="module")
def instances(tiny):
    from heterollm import LLM

    p = LLM(str(tiny), instance_role="PREFILL", kv_cache_transfer_mode="PULL", transfer_listen_port=free_port(),
            **COMMON)
    d = LLM(str(tiny), instance_role="DECODE", kv_cache_transfer_mode="PULL", transfer_listen_port=free_port(),
            **COMMON)
    yield p.engine, d.engine
    p.shutdown()
    d.shutdown()


def prefill(p, prompt):
    from heterollm import SamplingParams

    p.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), kv_transfer_params={"do_remote_decode": True})
    out = drain(p)[-1]
    assert out.finished and out.kv_transfer_params is not None
    return out.kv_transfer_params


def test_prefill_then_decode_gives_one_instances_tokens_and_frees_every_block(tiny, prompts, instances):
    from heterollm import LLM

    ref = LLM(str(tiny), **COMMON)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy())]
    ref.shutdown()
    p, d = instances
    free_p, free_d = p.kv.num_free_blocks, d.kv.num_free_blocks
    got = []
    for prompt in prompts:
        kv = prefill(p, prompt)
        assert kv["prompt_token_ids"] == prompt and kv["first_token_id"] == want[len(got)][0]
        assert len(kv["remote_block_ids"]) == -(-len(prompt) // 8) and len(kv["remote_ranks"]) == 1
        assert p.kv.num_free_blocks < free_p, "the prefill instance keeps the blocks for the pull"
        d.add_request(prompt, greedy(), kv_transfer_params=kv)
        outs = drain(d)
        assert outs[0].outputs[0].token_ids[:1] == [kv["first_token_id"]], "the first token is reported first"
        got.append(outs[-1].outputs[0].token_ids)
        assert outs[-1].metrics.num_prompt_tokens == len(prompt)
        assert p.release_kv(kv["remote_request_id"]) and not p.release_kv(kv["remote_request_id"])
    assert got == want
    assert p.kv.num_free_blocks == free_p and d.kv.num_free_blocks == free_d
    stats = d.stats()
    assert stats["kv_pull_blocks"] == sum(-(-len(x) // 8) for x in prompts) and stats["kv_pull_seconds"] > 0


def test_a_request_its_first_token_stops_still_goes_from_prefill_to_decode(prompts, instances):
    """The PREFILL instance keeps and describes the blocks of a request that its first token stops
    (finish "stop", not "length"): the router passes every PREFILL answer on, and the DECODE
    instance ends the request at that same token."""
    from heterollm import SamplingParams

    p, d = instances
    prompt = prompts[2]
    plain = prefill(p, prompt)
    assert p.release_kv(plain["remote_request_id"])
    token, free_p, free_d = plain["first_token_id"], p.kv.num_free_blocks, d.kv.num_free_blocks
    p.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, stop_token_ids=[token]),
                  kv_transfer_params={"do_remote_decode": True})
    out = drain(p)[-1]
    assert out.outputs[0].finish_reason == "stop" and out.kv_transfer_params is not None
    kv = out.kv_transfer_params
    assert kv["first_token_id"] == token and len(kv["remote_block_ids"]) == -(-len(prompt) // 8)
    assert p.kv.num_free_blocks == free_p - len(kv["remote_block_ids"]), "the blocks are kept for the pull"
    d.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, stop_token_ids=[token]), kv_transfer_params=kv)
    done = drain(d)[-1].outputs[0]
    assert done.token_ids == [token] and done.finish_reason == "stop"
    assert p.release_kv(kv["remote_request_id"])
    assert p.kv.num_free_blocks == free_p and d.kv.num_free_blocks == free_d


def test_the_decode_instances_prefix_cache_skips_blocks_it_holds(prompts, instances):
    p, d = instances
    prompt = prompts[3]  # 39 tokens: 4 full blocks + 7
    first = prefill(p, prompt)
    d.add_request(prompt, greedy(2), kv_transfer_params=first)
    a = drain(d)[-1]
    p.release_kv(first["remote_request_id"])
    again = prefill(p, prompt)
    d.add_request(prompt, greedy(2), kv_transfer_params=again)
    b = drain(d)[-1]
    p.release_kv(again["remote_request_id"])
    assert b.metrics.num_cached_tokens == 32 and b.outputs[0].token_ids == a.outputs[0].token_ids


def test_a_pull_from_a_dead_peer_ends_that_request_only(prompts, instances, caplog):
    p, d = instances
    kv = prefill(p, prompts[2])
    dead = f"127.0.0.1:{free_port()}"
    bad = {**kv, "remote_ranks": [{**kv["remote_ranks"][0], "addr": dead}]}
    free_d = d.kv.num_free_blocks
    d.add_request(prompts[2], greedy(), request_id="doomed", kv_transfer_params=bad)
    d.add_request(prompts[1], greedy(), request_id="plain")
    with caplog.at_level("WARNING", logger="heterollm.kv_cache.pd"):
        outs = {o.request_id: o for o in drain(d)}
    # the connector logs the request and why: its one rank's read from the dead address failed
    assert [m for m in caplog.messages if m.startswith("KV pull")] and all(
        m.startswith(f"KV pull for doomed failed: reading from the prefill instance's rank 0 ({dead}) failed")
        for m in caplog.messages if m.startswith("KV pull"))
    assert outs["doomed"].outputs[0].finish_reason == "error"
    assert "pulling the prompt's KV failed" in outs["doomed"].error and "127.0.0.1:" in outs["doomed"].error
    assert outs["plain"].outputs[0].finish_reason == "length" and outs["plain"].error is None
    assert d.kv.num_free_blocks == free_d
    assert p.release_kv(kv["remote_request_id"])


def step_until(engine, done, seconds=60.0):
    """Step `engine` until done(outputs so far) holds; fails past `seconds` instead of hanging."""
    import time

    outs, end = [], time.monotonic() + seconds
    while not done(outs):
        assert time.monotonic() < end, "the engine did not get there in time"
        outs += engine.step()
    return outs


@contextlib.contextmanager
def silent_peer(seconds=30.0):
    """A peer that accepts connections and never answers, like a frozen process (SIGSTOP): a
    transfer to it waits until the socket closes, at the block's end, or after `seconds` (so an
    engine that waits for it in its step fails the test instead of hanging it)."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    watchdog = threading.Timer(seconds, s.close)
    watchdog.start()
    try:
        yield f"127.0.0.1:{s.getsockname()[1]}"
    finally:
        watchdog.cancel()
        s.close()


@pytest.mark.parametrize("abort", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_silent_peer_holds_up_only_its_own_request(prompts, instances, abort):
    """The pull runs on the transfer threads: while the prefill instance does not answer, the decode
    instance serves its other requests to the end, and the waiting request keeps its blocks (an abort
    meanwhile too: the pull could still write into them). When the peer goes away the pull fails,
    the request ends with the reason, and every block comes back."""
    from heterollm.scheduler.request import RequestStatus

    p, d = instances
    kv = prefill(p, prompts[2])
    free_d = d.kv.num_free_blocks
    with silent_peer() as addr:
        d.add_request(prompts[2], greedy(), request_id="frozen",
                      kv_transfer_params={**kv, "remote_ranks": [{**kv["remote_ranks"][0], "addr": addr}]})
        d.add_request(prompts[1], greedy(), request_id="plain")
        outs = step_until(d, lambda outs: any(o.request_id == "plain" and o.finished for o in outs))
        assert d.scheduler.transferring["frozen"].status is RequestStatus.WAITING_FOR_REMOTE_KV
        assert d.stats()["kv_moving"] == 1
        assert not [o for o in outs if o.request_id == "frozen"], "nothing to say before its K/V is in"
        if abort:
            d.abort("frozen")
            assert not d.has_unfinished(), "nobody waits for it: the engine may idle"
            with pytest.raises(RequestRejected, match="already in use") as err:  # its blocks still bear the id
                d.add_request(prompts[1], greedy(), request_id="frozen")
            assert err.value.field == "request_id"
            d.check_health()  # what an idle serving loop calls: it polls the move, still under way
            assert "frozen" in d.scheduler.transferring
        else:
            assert d.has_unfinished()
        assert d.kv.num_free_blocks < free_d, "the blocks the pull writes into stay out of the pool"
    outs = step_until(d, lambda outs: not d.has_unfinished())
    if not abort:
        assert [o.outputs[0].finish_reason for o in outs if o.request_id == "frozen"] == ["error"]
        assert "pulling the prompt's KV failed" in [o for o in outs if o.request_id == "frozen"][0].error
    else:
        idle_until_moves_end(d)
    assert d.kv.num_free_blocks == free_d and not d.scheduler.transferring and d.stats()["kv_moving"] == 0
    assert p.release_kv(kv["remote_request_id"])


def test_a_move_that_raises_ends_its_request_with_the_exception(prompts, instances, monkeypatch):
    """A transfer call that raises (a bug, or a transport error the move did not name) fails the move
    as a named failure does: the request ends with the exception's type and text, every block comes
    back. The transfer threads are daemons: one stuck on a silent peer never holds up the exit."""
    p, d = instances
    conn = d.executor.runner.kv_connectors["mooncake_transfer"]
    threads = [t for t in threading.enumerate() if t.name.startswith("heterollm-kv-transfer-")]
    assert threads and all(t.daemon for t in threads)

    def broken(move, push, layers):
        raise RuntimeError("the transport fell over")

    monkeypatch.setattr(conn, "_move", broken)
    kv = prefill(p, prompts[1])
    free_d = d.kv.num_free_blocks
    d.add_request(prompts[1], greedy(), request_id="raised", kv_transfer_params=kv)
    out = drain(d)[-1]
    assert out.request_id == "raised" and out.outputs[0].finish_reason == "error"
    assert out.error == "pulling the prompt's KV failed: RuntimeError: the transport fell over"
    assert d.kv.num_free_blocks == free_d and not conn.moving
    assert p.release_kv(kv["remote_request_id"])


def test_closing_with_a_move_still_running_says_so(tiny, prompts, instances, caplog):
    """The transfer engine's launch line names its address. Shutting a DECODE instance down while a
    pull waits on a silent peer: the close does not wait for it, and says why the cache stays
    registered."""
    import time

    from heterollm import LLM

    p, _ = instances
    kv = prefill(p, prompts[2])
    with caplog.at_level(logging.INFO, logger="heterollm.kv_cache.pd"):
        d = LLM(str(tiny), instance_role="DECODE", kv_cache_transfer_mode="PULL", transfer_listen_port=free_port(),
                **COMMON).engine
    conn = d.executor.runner.kv_connectors["mooncake_transfer"]
    assert [r.getMessage() for r in caplog.records if r.name == "heterollm.kv_cache.pd"] == [
        f"KV transfer: rank 0 listens on {conn.addr}"]
    caplog.clear()
    with silent_peer() as addr:
        d.add_request(prompts[2], greedy(), request_id="frozen",
                      kv_transfer_params={**kv, "remote_ranks": [{**kv["remote_ranks"][0], "addr": addr}]})
        d.step()
        assert "frozen" in d.scheduler.transferring
        move = conn.moving["frozen"].futures[0]
        deadline = time.monotonic() + 10
        while not move.running():  # on a transfer thread, waiting for the peer
            assert time.monotonic() < deadline and not move.done()
            time.sleep(0.01)
        with caplog.at_level(logging.WARNING, logger="heterollm.kv_cache.pd"):
            d.shutdown()
    assert [r.getMessage() for r in caplog.records if r.name == "heterollm.kv_cache.pd"] == [
        "KV transfer: rank 0 closes with transfers still running (a peer that does not answer); its cache "
        "stays registered until the process ends"]
    assert p.release_kv(kv["remote_request_id"])


def test_pulling_requests_take_their_sequence_slots(prompts, instances, monkeypatch):
    """A pulling request runs once its K/V is in: it counts against --max_seqs_per_batch from its
    admission on, so pulls never make more sequences run than the limit allows."""
    from heterollm.scheduler.request import RequestStatus

    p, d = instances
    monkeypatch.setattr(d.scheduler, "config", d.scheduler.config.model_copy(update={"max_seqs_per_batch": 2}))
    kvs = [prefill(p, prompt) for prompt in prompts[:3]]
    free_d = d.kv.num_free_blocks
    for i, (prompt, kv) in enumerate(zip(prompts, kvs)):
        d.add_request(prompt, greedy(4), request_id=f"pd{i}", kv_transfer_params=kv)
    most, outs = 0, []
    while d.has_unfinished():
        outs += d.step()
        pulling = sum(r.status is RequestStatus.WAITING_FOR_REMOTE_KV for r in d.scheduler.transferring.values())
        most = max(most, pulling + len(d.scheduler.running))
    assert most == 2 and sorted(o.request_id for o in outs if o.finished) == ["pd0", "pd1", "pd2"]
    assert d.kv.num_free_blocks == free_d
    for kv in kvs:
        assert p.release_kv(kv["remote_request_id"])


@pytest.mark.slow  # 8 s: a third instance, with a host tier
def test_a_pull_into_blocks_the_host_tier_saves_from_waits_for_the_save(tiny, prompts, instances):
    """A DECODE instance with a host tier: admitting a pull evicts cached blocks, whose copies to the
    host are due before anything writes into them. In a step that runs nothing but the pull, the saves
    still go first: the prompt evicted comes back from the host tier with its own K/V (the same
    tokens as recomputing it), not with the pulled prompt's."""
    from heterollm import LLM

    rng = random.Random(7)
    fill = [[rng.randrange(100, 20000) for _ in range(31)] for _ in range(4)]  # 4 blocks each
    ref = LLM(str(tiny), **COMMON)
    want = ref.generate([fill[0]], greedy())[0].outputs[0].token_ids
    ref.shutdown()
    p, _ = instances
    d = LLM(str(tiny), instance_role="DECODE", kv_cache_transfer_mode="PULL", transfer_listen_port=free_port(),
            host_blocks_factor=4.0, **{**COMMON, "num_gpu_blocks_override": 16}).engine
    try:
        for prompt in fill:  # 16 blocks cached, fill[0]'s the least recently used
            d.add_request(prompt, greedy(1))
            drain(d)
        saved = d.stats()["host_tier_saved"]
        kv = prefill(p, prompts[3])  # 39 tokens: 5 blocks, evicting fill[0]'s
        d.add_request(prompts[3], greedy(1), kv_transfer_params=kv)
        drain(d)
        assert d.stats()["host_tier_saved"] > saved, "the pull's blocks came from evicting cached ones"
        p.release_kv(kv["remote_request_id"])
        loaded = d.stats()["host_tier_loaded"]
        d.add_request(fill[0], greedy())
        assert drain(d)[-1].outputs[0].token_ids == want
        assert d.stats()["host_tier_loaded"] > loaded, "fill[0]'s blocks came back from the host tier"
    finally:
        d.shutdown()


def idle_until_moves_end(engine, seconds=30.0):
    """An idle serving loop's health checks, until the moves nobody waits for ended."""
    import time

    end = time.monotonic() + seconds
    while engine.scheduler.transferring:
        assert time.monotonic() < end, "the abandoned move was never seen to end"
        engine.check_health()
        time.sleep(0.05)


def test_a_move_still_running_when_the_peers_hold_ran_out_ends_its_request(prompts, instances, monkeypatch):
    """A peer that never answers (Mooncake's handshake has no timeout of its own): once the prefill
    instance's hold on the blocks ran out, nothing the pull brings is usable. The request ends with
    that reason and the engine idles; the blocks come back when the move ends."""
    import time

    import heterollm.kv_cache.pd as pd

    monkeypatch.setattr(pd, "move_margin", lambda: 0.0)  # the move starts although its hold ends in 1.5 s
    p, d = instances
    kv = prefill(p, prompts[2])
    free_d = d.kv.num_free_blocks
    with silent_peer() as addr:
        began = time.monotonic()
        d.add_request(prompts[2], greedy(), request_id="frozen", kv_transfer_params={
            **kv, "remote_ranks": [{**kv["remote_ranks"][0], "addr": addr}], "expires_at": time.time() + 1.5})
        outs = step_until(d, lambda outs: not d.has_unfinished())
        assert 1 <= time.monotonic() - began < 20
        assert [o.outputs[0].finish_reason for o in outs if o.request_id == "frozen"] == ["error"]
        assert "did not end before the peer's hold on the blocks ran out" in outs[-1].error
        assert "frozen" in d.scheduler.transferring and d.kv.num_free_blocks < free_d
    idle_until_moves_end(d)
    assert d.kv.num_free_blocks == free_d
    assert p.release_kv(kv["remote_request_id"])


def late_clock(monkeypatch):
    """The transfer connector's wall clock jumps 1,000 s once the move's start was checked: the move
    ends after the peer's hold ran out."""
    import time

    import heterollm.kv_cache.pd as pd

    calls = []

    def now():
        calls.append(1)
        return time.time() + (1000 if len(calls) > 1 else 0)

    monkeypatch.setattr(pd, "time", type("Clock", (), {"time": staticmethod(now)}))


@pytest.mark.parametrize("late", ["start", "end"])
def test_a_pull_keeps_within_the_prefill_instances_hold(prompts, instances, monkeypatch, late):
    """The prefill instance frees held blocks when its hold runs out (its answer says when: expires_at):
    the decode instance does not start reading within the transport's timeout (+ 5 s) of that, and
    drops what a read that ended after it brought (the request fails with the reason)."""
    import time

    from heterollm.kv_cache.pd import HOLD_TIMEOUT_S, move_margin

    p, d = instances
    kv = prefill(p, prompts[1])
    assert time.time() + HOLD_TIMEOUT_S - 5 < kv["expires_at"] <= time.time() + HOLD_TIMEOUT_S
    free_d, pulled = d.kv.num_free_blocks, d.stats()["kv_pull_blocks"]
    if late == "end":
        late_clock(monkeypatch)
    d.add_request(prompts[1], greedy(), request_id="late", kv_transfer_params={
        **kv, "expires_at": time.time() + (move_margin() - 1 if late == "start" else 1000)})
    out = drain(d)[-1]
    assert out.outputs[0].finish_reason == "error"
    assert out.error == "pulling the prompt's KV failed: " + (
        "the prefill instance's hold on the blocks runs out in less than 35 s (held 120 s): its blocks may be "
        "another request's before the transfer ends, nothing is read" if late == "start" else
        "the transfer ended after the prefill instance's hold on the blocks ran out: the prefill instance may "
        "have given the blocks to another request; what was read is dropped")
    assert d.kv.num_free_blocks == free_d and d.stats()["kv_pull_blocks"] == pulled
    assert p.release_kv(kv["remote_request_id"])


def test_held_blocks_are_freed_when_nobody_releases_them(prompts, instances, monkeypatch, caplog):
    import heterollm.scheduler.scheduler as sched

    p, _ = instances
    free_p = p.kv.num_free_blocks
    monkeypatch.setattr(sched, "HOLD_TIMEOUT_S", 0.0)
    prefill(p, prompts[1])
    assert p.kv.num_free_blocks < free_p
    held = list(p.scheduler.held)
    p.add_request([5, 6, 7], greedy(1))  # any later step expires the hold
    with caplog.at_level(logging.WARNING):
        drain(p)
    assert p.kv.num_free_blocks == free_p and not p.scheduler.held
    assert [r.getMessage() for r in caplog.records if r.getMessage().startswith("PD:")] == [
        f"PD: the blocks kept for {rid} were not released within 0 s; freeing them" for rid in held]


def test_bad_params_are_refused_naming_the_field(prompts, instances):
    from heterollm import SamplingParams

    p, d = instances
    kv = prefill(p, prompts[1])
    cases = [
        (d, {**kv, "prompt_token_ids": kv["prompt_token_ids"][:-1]}, greedy(), "kv_transfer_params", "differ"),
        (d, {**kv, "block_size": 16}, greedy(), "kv_transfer_params", "block_size 16"),
        (d, {**kv, "remote_ranks": "x"}, greedy(), "kv_transfer_params", "remote_ranks"),
        (d, {k: v for k, v in kv.items() if k != "first_token_id"}, greedy(), "kv_transfer_params", "first_token_id"),
        (d, kv, SamplingParams(max_tokens=3, logprobs=1), "logprobs", "first token"),
        (d, kv, SamplingParams(max_tokens=3, n=2), "kv_transfer_params", "n = 1"),
        (p, kv, greedy(), "kv_transfer_params", "role is PREFILL"),
        (d, {"do_remote_decode": True}, greedy(), "kv_transfer_params", "role is DECODE"),
        (d, {"other": 1}, greedy(), "kv_transfer_params", "do_remote_decode or do_remote_prefill"),
    ]
    for engine, params, sampling, field, words in cases:
        with pytest.raises(RequestRejected, match=words) as info:
            engine.add_request(prompts[1], sampling, kv_transfer_params=params)
        assert info.value.field == field
    assert not d.has_unfinished()
    p.release_kv(kv["remote_request_id"])


def test_launch_checks_name_the_flag():
    def problems(*argv):
        return check_flag_combinations(load_config(["--model", "m", *argv]).config)

    assert not problems("--instance_role", "PREFILL")  # PUSH, xLLM's default
    assert not problems("--instance_role", "DECODE", "--kv_cache_transfer_mode", "PULL")
    assert not problems("--splitwise_role", "prefill", "--kv_cache_transfer_mode", "PULL", "--enable_disagg_pd")
    assert any("contradicts" in p for p in problems("--splitwise_role", "decode", "--instance_role", "PREFILL"))
    assert any(p.startswith("--enable_disagg_pd=true: needs --instance_role") for p in problems("--enable_disagg_pd"))
    assert any(p.startswith("--transfer_listen_port: only a PREFILL or DECODE")
               for p in problems("--transfer_listen_port", "27000"))
    assert any(p.startswith("--disagg_pd_port:") for p in problems("--disagg_pd_port", "7000"))
    assert any(p.startswith("--kv_push_dst_rotate=true:") for p in problems("--instance_role", "DECODE",
                                                                       "--kv_cache_transfer_mode", "PULL",
                                                                       "--kv_push_dst_rotate"))
    assert any(p.startswith("--innode_prefill_ports:") for p in problems("--innode_prefill_ports", "8001"))


def test_the_role_comes_from_instance_role_or_splitwise_role():
    from heterollm.kv_cache.pd import is_disaggregated, pd_role

    def role(*argv):
        config = load_config(["--model", "m", *argv]).config
        return pd_role(config), is_disaggregated(config)

    assert role() == ("DEFAULT", False)
    assert role("--instance_role", "MIX") == ("MIX", False)
    assert role("--instance_role", "PREFILL") == ("PREFILL", True)
    assert role("--instance_role", "DECODE") == ("DECODE", True)
    assert role("--splitwise_role", "prefill") == ("PREFILL", True)
    assert role("--splitwise_role", "decode", "--instance_role", "PREFILL") == ("DECODE", True)
    assert role("--splitwise_role", "mixed", "--instance_role", "DECODE") == ("DECODE", True)


def test_launch_checks_say_the_whole_problem():
    from heterollm.kv_cache.pd import pd_problems

    def problems(*argv):
        return pd_problems(load_config(["--model", "m", *argv]).config)

    pull = ("--kv_cache_transfer_mode", "PULL")
    assert problems() == []
    assert problems("--instance_role", "PREFILL", *pull) == []
    assert problems("--splitwise_role", "prefill", "--instance_role", "PREFILL", *pull) == []
    assert problems("--splitwise_role", "decode", "--instance_role", "PREFILL", *pull) == [
        "--splitwise_role=decode contradicts --instance_role=PREFILL"]
    assert problems("--disagg_pd_port", "7000") == [
        "--disagg_pd_port: heterollm's instances exchange PD control over their HTTP API port (the router calls "
        "/v1/kv_transfer/release there); there is no separate bRPC server to place"]
    assert problems("--innode_prefill_ports", "8001") == [
        "--innode_prefill_ports: FastDeploy's in-node prefill engine ports; heterollm's PREFILL instances are "
        "reached through the router (heterollm route --prefill_instances / etcd)"]
    assert problems("--enable_disagg_pd") == [
        "--enable_disagg_pd=true: needs --instance_role PREFILL or DECODE (or --splitwise_role prefill / decode)"]
    assert problems("--instance_role", "MIX", *pull, "--transfer_listen_port", "27000", "--kv_push_dst_rotate") == [
        f"--{name}: only a PREFILL or DECODE instance transfers KV (--instance_role)"
        for name in ("kv_cache_transfer_mode", "transfer_listen_port", "kv_push_dst_rotate")]
    assert problems("--instance_role", "PREFILL") == []
    assert problems("--instance_role", "PREFILL", "--kv_push_dst_rotate") == []
    assert problems("--instance_role", "PREFILL", *pull, "--kv_push_dst_rotate") == [
        "--kv_push_dst_rotate=true: rotates the decode ranks a PREFILL instance pushes to; with "
        "--kv_cache_transfer_mode=PULL nothing is pushed"]
    assert problems("--instance_role", "DECODE", "--kv_push_dst_rotate") == [
        "--kv_push_dst_rotate=true: rotates the decode ranks a PREFILL instance pushes to; a DECODE instance "
        "pushes nothing"]
    assert problems("--instance_role", "DECODE", *pull, "--dp_size", "2", "--ep_size", "2") == [
        "--instance_role=DECODE: not built with attention data parallelism"]
    assert problems("--instance_role", "PREFILL", *pull, "--draft_model", "d") == [
        "--instance_role=PREFILL: a draft model's KV cache is not transferred: not served with --draft_model"]
    assert problems("--instance_role", "PREFILL", *pull, "--nnodes", "2") == [
        "--instance_role=PREFILL: one node per instance (--nnodes > 1 is not built for PD)"]


def test_the_transfer_connector_refuses_a_cache_of_another_layout_and_only_moves_between_instances():
    """It moves caches laid out (K/V, heads, blocks, block size, head dim) along dimension 2: anything
    else (MLA's latent cache, another backend's layout) is refused before Mooncake is touched."""
    import torch

    from heterollm.config import ConfigError
    from heterollm.kv_cache.pd import MooncakeTransferConnector

    good = torch.zeros(2, 2, 4, 8, 16)
    cases = [([], 2, ()), ([torch.zeros(2, 4, 8, 16)], 2, (2, 4, 8, 16)), ([good], 3, (2, 2, 4, 8, 16)),
             ([torch.zeros(3, 2, 4, 8, 16), good], 2, (3, 2, 4, 8, 16))]
    for caches, block_dim, shape in cases:
        with pytest.raises(ConfigError, match=r"^--instance_role: PD disaggregation moves caches laid out \(K/V, "
                                              r"heads, blocks, block size, head dim\); this model's cache is "
                                              + re.escape(str(shape)) + r" \(MLA caches are not built\)$"):
            MooncakeTransferConnector(None, caches, block_dim, 0)
    for method in (MooncakeTransferConnector.save, MooncakeTransferConnector.load):
        with pytest.raises(NotImplementedError, match=r"^the transfer connector only pulls and pushes between instances$"):
            method(None, [(0, 0)])


def test_peers_from_reads_each_rank_and_names_what_is_wrong():
    from heterollm.interfaces.kv_connector import PeerRank
    from heterollm.kv_cache.pd import peers_from

    rank = {"addr": "h:1", "ptrs": [10, "20"], "shape": [2, 4, 40, 8, 16], "dtype": "torch.float32"}
    assert peers_from({"remote_ranks": [rank, {**rank, "addr": 5}]}) == (
        PeerRank(addr="h:1", ptrs=(10, 20), shape=(2, 4, 40, 8, 16), dtype="torch.float32"),
        PeerRank(addr="5", ptrs=(10, 20), shape=(2, 4, 40, 8, 16), dtype="torch.float32"))
    for params in ({}, {"remote_ranks": []}, {"remote_ranks": "x"}):
        with pytest.raises(ValueError, match=r"^remote_ranks must be a non-empty list$"):
            peers_from(params)
    for bad in ({k: v for k, v in rank.items() if k != "dtype"}, {**rank, "ptrs": ["x"]}, {**rank, "ptrs": 5},
                {**rank, "shape": None}):
        with pytest.raises(ValueError, match=r"^remote_ranks\[1\] needs addr, ptrs, shape and dtype$"):
            peers_from({"remote_ranks": [rank, bad]})
    with pytest.raises(ValueError, match=r"^remote_ranks\[0\]\.shape must have 5 dimensions$"):
        peers_from({"remote_ranks": [{**rank, "shape": [2, 4, 40, 8]}]})


@pytest.mark.slow
@pytest.mark.parametrize("tp_p,tp_d", [(1, 2), (2, 1)])
def test_different_tensor_parallel_sizes(tiny, prompts, tp_p, tp_d):
    """Each DECODE rank reads its own heads, from whichever PREFILL rank holds them."""
    from heterollm import LLM

    ref = LLM(str(tiny), **COMMON)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy())]
    ref.shutdown()
    p = LLM(str(tiny), instance_role="PREFILL", kv_cache_transfer_mode="PULL", transfer_listen_port=free_port(),
            tp_size=tp_p, **COMMON)
    d = LLM(str(tiny), instance_role="DECODE", kv_cache_transfer_mode="PULL", transfer_listen_port=free_port(),
            tp_size=tp_d, **COMMON)
    try:
        got = []
        for prompt in prompts:
            kv = prefill(p.engine, prompt)
            assert len(kv["remote_ranks"]) == tp_p
            d.engine.add_request(prompt, greedy(), kv_transfer_params=kv)
            got.append(drain(d.engine)[-1].outputs[0].token_ids)
            assert p.engine.release_kv(kv["remote_request_id"])
        assert got == want
    finally:
        p.shutdown()
        d.shutdown()
