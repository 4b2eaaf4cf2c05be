"""Prefill/decode disaggregation in PUSH mode (xLLM's default), engine side (kv_cache/pd.py): a
DECODE engine reserves blocks for a prompt, the PREFILL engine writes the prompt's K/V into them over
Mooncake's transfer engine (TCP, real) right after its forward, and the DECODE engine takes them over
and decodes with the same greedy tokens as one instance; its prefix cache means fewer blocks are
written; a push to a dead peer ends only that request; unclaimed reservations are freed; every block
comes back on both sides; the two instances must run the same mode."""
from __future__ import annotations

import pytest

from heterollm.scheduler.request import RequestRejected

from test_pd_engine import (COMMON, drain, free_port, greedy, idle_until_moves_end, late_clock,  # noqa: F401
                            prompts, silent_peer, step_until, tiny)


@pytest.fixture(scope="module")
def push_instances(tiny):
    from heterollm import LLM

    p = LLM(str(tiny), instance_role="PREFILL", transfer_listen_port=free_port(), **COMMON)
    d = LLM(str(tiny), instance_role="DECODE", transfer_listen_port=free_port(), **COMMON)
    assert p.engine.config.pd.kv_cache_transfer_mode == "PUSH" == d.engine.config.pd.kv_cache_transfer_mode
    yield p.engine, d.engine
    p.shutdown()
    d.shutdown()


def prefill_into(p, prompt, reservation, request_id=None):
    from heterollm import SamplingParams

    p.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), request_id=request_id,
                  kv_transfer_params=reservation)
    return drain(p)


def test_push_gives_one_instances_tokens_and_frees_every_block(tiny, prompts, push_instances):
    from heterollm import LLM

    ref = LLM(str(tiny), **COMMON)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy())]
    ref.shutdown()
    p, d = push_instances
    free_p, free_d = p.kv.num_free_blocks, d.kv.num_free_blocks
    pushed0 = p.stats()["kv_push_blocks"]
    got, written = [], 0
    for prompt in prompts:
        res = d.reserve_kv(prompt)
        assert res["num_prompt_tokens"] == len(prompt) and len(res["remote_ranks"]) == 1
        assert len(res["remote_block_ids"]) == -(-(len(prompt) + 1) // 8), "the prompt and its first token"
        assert d.stats()["kv_reservations"] == 1 and d.kv.num_free_blocks < free_d
        written += -(-len(prompt) // 8) - res["cached_blocks"]
        out = prefill_into(p, prompt, res)[-1]
        kv = out.kv_transfer_params
        assert out.finished and out.error is None
        assert kv["reservation_id"] == res["reservation_id"] and kv["first_token_id"] == want[len(got)][0]
        assert "remote_ranks" not in kv, "nothing is left to pull"
        assert p.kv.num_free_blocks == free_p, "PUSH keeps nothing on the prefill instance"
        d.add_request(prompt, greedy(), kv_transfer_params=kv)
        assert not d.scheduler.reserved, "the request took the reservation over"
        outs = drain(d)
        assert outs[0].outputs[0].token_ids[:1] == [kv["first_token_id"]]
        got.append(outs[-1].outputs[0].token_ids)
    assert got == want
    assert p.kv.num_free_blocks == free_p and d.kv.num_free_blocks == free_d
    assert p.stats()["kv_push_blocks"] - pushed0 == written > 0 and p.stats()["kv_push_seconds"] > 0
    assert d.stats()["kv_pull_blocks"] == 0


def test_the_decode_instances_prefix_cache_means_fewer_blocks_written(prompts, push_instances):
    p, d = push_instances
    prompt = prompts[3]  # 39 tokens: 4 full blocks + 7
    outs = []
    for _ in range(2):
        res = d.reserve_kv(prompt)
        before = p.stats()["kv_push_blocks"]
        kv = prefill_into(p, prompt, res)[-1].kv_transfer_params
        outs.append((res["cached_blocks"], p.stats()["kv_push_blocks"] - before))
        d.add_request(prompt, greedy(3), kv_transfer_params=kv)
        last = drain(d)[-1]
        outs[-1] += (last.outputs[0].token_ids, last.metrics.num_cached_tokens)
    (c1, w1, t1, n1), (c2, w2, t2, n2) = outs
    assert (c2, w2) == (4, 1) and w1 == 5 - c1 and t1 == t2
    assert (n1, n2) == (c1 * 8, 32), "the decode instance's own prefix-cache hits (blocks of 8), as usage counts them"


def test_a_chunked_prefill_pushes_once_its_last_chunk_ran(tiny, prompts, push_instances):
    """With 16-token chunks the 39-token prompt takes three steps; only the last one pushes, and it
    pushes every block (the earlier chunks' too)."""
    from heterollm import LLM

    _, d = push_instances
    ref = LLM(str(tiny), **COMMON)
    want = ref.generate([prompts[3]], greedy())[0].outputs[0].token_ids
    ref.shutdown()
    p = LLM(str(tiny), instance_role="PREFILL", transfer_listen_port=free_port(), max_tokens_per_chunk_for_prefill=16,
            **COMMON).engine
    try:
        d.scheduler.kv.reset_prefix_cache()
        res = d.reserve_kv(prompts[3])
        assert res["cached_blocks"] == 0
        from heterollm import SamplingParams

        pushed, outs = [], []  # per step run: the blocks it started pushing
        run = p.executor.execute

        def counting(so):
            moves = (so.kv_transfers or {}).get("mooncake_transfer")
            pushed.append(sum(len(m.local_blocks) for m in moves.pushes) if moves else 0)
            return run(so)

        p.executor.execute = counting
        p.add_request(prompts[3], SamplingParams(max_tokens=1, temperature=0), kv_transfer_params=res)
        while p.has_unfinished():
            step = p.step()
            assert not step or p.stats()["kv_push_blocks"] == 5, "the answer waits for the push to end"
            outs += step
        assert pushed[:3] == [0, 0, 5] and sum(pushed) == 5 and len(outs) == 1 and outs[0].finished
        d.add_request(prompts[3], greedy(), kv_transfer_params=outs[-1].kv_transfer_params)
        assert drain(d)[-1].outputs[0].token_ids == want
    finally:
        p.shutdown()


def test_a_push_to_a_dead_peer_ends_that_request_only(prompts, push_instances, caplog):
    p, d = push_instances
    free_p, free_d = p.kv.num_free_blocks, d.kv.num_free_blocks
    res = d.reserve_kv(prompts[2])
    dead = f"127.0.0.1:{free_port()}"
    bad = {**res, "remote_ranks": [{**res["remote_ranks"][0], "addr": dead}]}
    from heterollm import SamplingParams

    p.add_request(prompts[2], SamplingParams(max_tokens=1, temperature=0), request_id="doomed",
                  kv_transfer_params=bad)
    p.add_request(prompts[1], greedy(4), request_id="plain")
    with caplog.at_level("WARNING", logger="heterollm"):
        outs = {o.request_id: o for o in drain(p)}
    # the engine's line names the request and says why, as its output's error does
    why = outs["doomed"].error.split("pushing the prompt's KV failed: ", 1)[1]
    assert f"request doomed: {why}" in caplog.messages
    assert [m for m in caplog.messages if m.startswith("KV push")] and all(
        m.startswith(f"KV push for doomed failed: writing to the decode instance's rank 0 ({dead}) failed")
        for m in caplog.messages if m.startswith("KV push"))
    assert outs["doomed"].outputs[0].finish_reason == "error" and outs["doomed"].kv_transfer_params is None
    assert "pushing the prompt's KV failed" in outs["doomed"].error
    assert outs["plain"].outputs[0].finish_reason == "length" and len(outs["plain"].outputs[0].token_ids) == 4
    assert p.kv.num_free_blocks == free_p
    assert d.release_kv(res["reservation_id"]) and not d.release_kv(res["reservation_id"])
    assert d.kv.num_free_blocks == free_d and not d.scheduler.reserved


def test_a_silent_decode_instance_holds_up_only_the_answer_that_waits_for_it(prompts, push_instances):
    """The push runs on the transfer threads: while the decode instance does not answer, the prefill
    instance serves its other requests, keeps the pushing request's blocks (the writes read them) and
    holds back its answer (the signal that the K/V is in place). When the peer goes away the push
    fails: the answer is the error, and every block comes back."""
    from heterollm import SamplingParams

    p, d = push_instances
    free_p = p.kv.num_free_blocks
    res = d.reserve_kv(prompts[3])
    with silent_peer() as addr:
        p.add_request(prompts[3], SamplingParams(max_tokens=1, temperature=0), request_id="frozen",
                      kv_transfer_params={**res, "remote_ranks": [{**res["remote_ranks"][0], "addr": addr}]})
        p.add_request(prompts[1], greedy(6), request_id="plain")
        outs = step_until(p, lambda outs: any(o.request_id == "plain" and o.finished for o in outs))
        assert not [o for o in outs if o.request_id == "frozen"], "no answer before the K/V is in place"
        assert "frozen" in p.scheduler.transferring and p.kv.num_free_blocks < free_p
    outs = step_until(p, lambda outs: not p.has_unfinished())
    frozen = [o for o in outs if o.request_id == "frozen"]
    assert len(frozen) == 1 and frozen[0].outputs[0].finish_reason == "error"
    assert "pushing the prompt's KV failed" in frozen[0].error and frozen[0].kv_transfer_params is None
    assert p.kv.num_free_blocks == free_p and not p.scheduler.transferring
    assert d.release_kv(res["reservation_id"])


def test_a_step_that_fails_before_its_push_leaves_no_request_waiting_for_it(prompts, push_instances, monkeypatch):
    """The forward of the step that would push raises: the push never started, so it ends as failed at
    the next step; the aborted request (what a serving loop does after a failed step) gives its blocks
    back, and the engine idles again instead of waiting for a push that never comes."""
    from heterollm import SamplingParams

    p, d = push_instances
    free_p = p.kv.num_free_blocks
    res = d.reserve_kv(prompts[2])
    runner = p.executor.runner
    forward = runner._forward

    def broken(inputs):
        raise RuntimeError("the device fell over")

    monkeypatch.setattr(runner, "_forward", broken)
    p.add_request(prompts[2], SamplingParams(max_tokens=1, temperature=0), request_id="broken",
                  kv_transfer_params=res)
    with pytest.raises(RuntimeError, match="fell over"):
        p.step()
    monkeypatch.setattr(runner, "_forward", forward)
    assert "broken" in p.scheduler.transferring
    p.abort("broken")
    assert not p.has_unfinished()
    idle_until_moves_end(p, 10)  # the idle loop's health checks poll the failed push
    assert p.kv.num_free_blocks == free_p
    assert d.release_kv(res["reservation_id"])


def test_pushing_caches_hand_each_group_over_once_the_forward_is_past_it():
    """Reading layer l means the layers before l wrote their K/V: a group is handed over when the forward
    reads the first layer after it, never before; the last group is left to after_forward. Built over
    a WaitingCaches (host-tier loads), it waits for nothing at construction and reads through it."""
    import torch

    from heterollm.model_executor.layerwise import PushingCaches, WaitingCaches, layer_groups

    class Load:
        waits: list[int] = []
        joined = False

        def wait(self, layer):
            self.waits.append(layer)

        def join(self):
            self.joined = True

    caches, load, reading, handed = [torch.full((1,), float(i)) for i in range(5)], Load(), [], []
    pushing = PushingCaches(WaitingCaches(caches, [load]), layer_groups(5, 2),
                            lambda layers: handed.append((layers, reading[-1])))
    assert not load.joined and len(pushing) == 5
    assert pushing[-1] is caches[4] and handed == [], "the last layer read from the end says nothing"
    for layer in range(5):
        reading.append(layer)
        assert pushing[layer] is caches[layer]
    assert handed == [(range(0, 3), 3)] and load.waits == [4, 0, 1, 2, 3, 4]
    assert pushing[1] is caches[1] and handed == [(range(0, 3), 3)], "a layer read again hands nothing twice"


def test_a_push_goes_layer_by_layer_beside_the_forward(tiny, prompts, push_instances, monkeypatch):
    """The tiny model's two layers in two groups: layer 0's blocks are handed over while the forward runs
    (when it reads layer 1), layer 1's after it; the decode instance gets the same tokens as one
    instance."""
    from heterollm import LLM, SamplingParams

    ref = LLM(str(tiny), **COMMON)
    want = ref.generate([prompts[3]], greedy())[0].outputs[0].token_ids
    ref.shutdown()
    p, d = push_instances
    conn = p.executor.runner.kv_connectors["mooncake_transfer"]
    events, moved = [], []
    push_layers, after_forward, move = conn.push_layers, conn.after_forward, conn._move

    def handed(pushes, layers):
        events.append(("during", layers))
        push_layers(pushes, layers)

    def after(transfers):
        events.append(("after", None) if transfers.pushes else ("after-nothing", None))
        return after_forward(transfers)

    def moving(m, push, layers):
        moved.append(layers)
        return move(m, push, layers)

    monkeypatch.setattr(conn, "push_layers", handed)
    monkeypatch.setattr(conn, "after_forward", after)
    monkeypatch.setattr(conn, "_move", moving)
    d.scheduler.kv.reset_prefix_cache()
    res = d.reserve_kv(prompts[3])
    p.add_request(prompts[3], SamplingParams(max_tokens=1, temperature=0), kv_transfer_params=res)
    kv = drain(p)[-1].kv_transfer_params
    assert events == [("during", range(0, 1)), ("after", None)]
    assert sorted(moved, key=lambda r: r.start) == [range(0, 1), range(1, 2)]
    d.add_request(prompts[3], greedy(), kv_transfer_params=kv)
    assert drain(d)[-1].outputs[0].token_ids == want


def test_a_step_that_fails_after_handing_a_layer_over_ends_its_push(prompts, push_instances, monkeypatch):
    """The forward fails after layer 0's blocks were handed over: the push is failed, P's blocks come back
    once that layer's transfer ended, and the connector forgets the move."""
    from heterollm import SamplingParams

    p, d = push_instances
    free_p = p.kv.num_free_blocks
    conn = p.executor.runner.kv_connectors["mooncake_transfer"]
    push_layers = conn.push_layers

    def then_fail(pushes, layers):
        push_layers(pushes, layers)
        raise RuntimeError("the device fell over at layer 1")

    monkeypatch.setattr(conn, "push_layers", then_fail)
    res = d.reserve_kv(prompts[3])
    p.add_request(prompts[3], SamplingParams(max_tokens=1, temperature=0), request_id="broken",
                  kv_transfer_params=res)
    with pytest.raises(RuntimeError, match="layer 1"):
        p.step()
    monkeypatch.setattr(conn, "push_layers", push_layers)
    assert list(conn.moving) == ["broken"] and not conn.moving["broken"].sealed
    p.abort("broken")
    idle_until_moves_end(p, 10)
    assert p.kv.num_free_blocks == free_p and not conn.moving
    assert d.release_kv(res["reservation_id"])


def test_an_unclaimed_reservation_is_freed_and_cannot_be_claimed_after(prompts, push_instances, monkeypatch):
    import heterollm.scheduler.scheduler as sched

    p, d = push_instances
    free_d = d.kv.num_free_blocks
    monkeypatch.setattr(sched, "HOLD_TIMEOUT_S", 0.0)
    res = d.reserve_kv(prompts[1])
    kv = prefill_into(p, prompts[1], res)[-1].kv_transfer_params
    d.add_request([5, 6, 7], greedy(1))  # any later step expires the reservation
    drain(d)
    assert d.kv.num_free_blocks == free_d and not d.scheduler.reserved
    with pytest.raises(RequestRejected, match="unknown or expired") as info:
        d.add_request(prompts[1], greedy(), request_id="late", kv_transfer_params=kv)
    assert info.value.field == "kv_transfer_params" and info.value.status == 502
    assert not d.has_unfinished() and d.kv.num_free_blocks == free_d


def test_a_full_cache_refuses_a_reservation_and_an_aborted_claim_frees_it(prompts, push_instances):
    p, d = push_instances
    free_d = d.kv.num_free_blocks
    big = [7] * 100  # 13 blocks each: a fourth does not fit the 40-block pool
    held = [d.reserve_kv(big) for _ in range(3)]
    with pytest.raises(RequestRejected, match="no room for 100 prompt tokens") as info:
        d.reserve_kv(big)
    assert info.value.status == 503
    ids = {res["reservation_id"] for res in held}
    assert set(d.kv.tables) == set(d.kv._hashes) == ids, "the refused reservation's prefix lookup is forgotten"
    with pytest.raises(RequestRejected, match="max_model_len 128") as info:
        d.reserve_kv([7] * 128)
    assert info.value.field == "prompt"
    for res in held:
        d.release_kv(res["reservation_id"])
    assert d.kv.num_free_blocks == free_d
    res = d.reserve_kv(prompts[1])
    kv = prefill_into(p, prompts[1], res)[-1].kv_transfer_params
    d.add_request(prompts[1], greedy(), request_id="gone", kv_transfer_params=kv)
    d.abort("gone")
    drain(d)
    assert d.kv.num_free_blocks == free_d and not d.has_unfinished()


def test_both_instances_must_run_the_same_mode_and_bad_params_are_refused(tiny, prompts, push_instances):
    p, d = push_instances
    res = d.reserve_kv(prompts[1])
    cases = [
        (p, {"do_remote_decode": True}, "runs --kv_cache_transfer_mode=PUSH, the decode instance PULL"),
        (p, {**res, "num_prompt_tokens": 3}, "reserved blocks for 3 prompt tokens"),
        (p, {**res, "remote_block_ids": [1]}, "remote_block_ids do not cover the prompt"),
        (p, {**res, "cached_blocks": 9}, "remote_block_ids do not cover the prompt"),
        (p, {**res, "block_size": 16}, "block_size 16"),
        (p, {**res, "remote_block_ids": [10**6] * len(res["remote_block_ids"])},
         "remote_block_ids name blocks outside the decode instance's cache"),
        (p, {k: v for k, v in res.items() if k != "cached_blocks"}, "not a decode instance's reservation"),
        (d, {"do_remote_prefill": True, "remote_ranks": res["remote_ranks"], "remote_block_ids": [1, 2],
             "first_token_id": 1, "prompt_token_ids": prompts[1], "block_size": 8}, "these params are a PULL"),
        (d, {"do_remote_prefill": True, "reservation_id": res["reservation_id"], "first_token_id": 1,
             "prompt_token_ids": prompts[1][:-1]}, "prompt_token_ids differ"),
        (d, {"do_remote_prefill": True, "reservation_id": res["reservation_id"], "first_token_id": -1,
             "prompt_token_ids": prompts[1]}, "outside the vocabulary"),
        (d, {"do_remote_prefill": True, "reservation_id": "kvres-none", "first_token_id": 1,
             "prompt_token_ids": prompts[1]}, "unknown or expired"),
    ]
    for engine, params, words in cases:
        with pytest.raises(RequestRejected, match=words) as info:
            engine.add_request(prompts[1], greedy(1), kv_transfer_params=params)
        assert info.value.field == "kv_transfer_params"
    other = d.reserve_kv(prompts[1])  # claimed with another prompt (tokenized alike on both sides)
    with pytest.raises(RequestRejected, match=f"reservation '{other['reservation_id']}' was made for another prompt"
                       ) as info:
        d.add_request(prompts[0], greedy(1), kv_transfer_params={
            "do_remote_prefill": True, "reservation_id": other["reservation_id"], "first_token_id": 1,
            "prompt_token_ids": prompts[0]})
    assert info.value.field == "kv_transfer_params"
    with pytest.raises(RequestRejected, match="role is PREFILL"):
        p.reserve_kv(prompts[1])
    assert not p.has_unfinished() and not d.has_unfinished()
    assert not d.scheduler.reserved, "a refused claim frees the reservation it names"
    assert not d.release_kv(res["reservation_id"])


@pytest.mark.parametrize("late", ["start", "end"])
def test_a_push_keeps_within_its_reservations_hold(prompts, push_instances, monkeypatch, late):
    """The decode instance may have freed (and reused) the blocks of a reservation whose hold ran out:
    the prefill instance does not start writing within the transport's timeout (+ 5 s) of its end, and
    a write that ended after it fails the request, with the reason."""
    import time

    from heterollm import SamplingParams
    from heterollm.kv_cache.pd import move_margin

    p, d = push_instances
    free_p = p.kv.num_free_blocks
    res = d.reserve_kv(prompts[1])
    pushed = p.stats()["kv_push_blocks"]
    expires_at = time.time() + (move_margin() - 1 if late == "start" else 1000)
    if late == "end":
        late_clock(monkeypatch)
    p.add_request(prompts[1], SamplingParams(max_tokens=1, temperature=0), request_id="late",
                  kv_transfer_params={**res, "expires_at": expires_at})
    out = drain(p)[-1]
    assert out.outputs[0].finish_reason == "error" and out.kv_transfer_params is None
    assert ("runs out in less than 35 s" if late == "start" else "ended after the decode instance's reservation "
            "ran out") in out.error
    assert p.stats()["kv_push_blocks"] == pushed, "a failed push counts no block"
    assert p.kv.num_free_blocks == free_p and d.release_kv(res["reservation_id"])


def test_a_refused_claim_frees_its_reservation_and_reserving_expires_stale_ones(prompts, push_instances, monkeypatch):
    import heterollm.scheduler.scheduler as sched
    from heterollm import SamplingParams

    p, d = push_instances
    free_d = d.kv.num_free_blocks
    res = d.reserve_kv(prompts[1])
    kv = prefill_into(p, prompts[1], res)[-1].kv_transfer_params
    with pytest.raises(RequestRejected, match="first token"):
        d.add_request(prompts[1], SamplingParams(max_tokens=3, logprobs=1), kv_transfer_params=kv)
    assert not d.scheduler.reserved and d.kv.num_free_blocks == free_d, "refused after P wrote: freed at once"
    monkeypatch.setattr(sched, "HOLD_TIMEOUT_S", 0.0)
    d.reserve_kv(prompts[2])
    monkeypatch.setattr(sched, "HOLD_TIMEOUT_S", 60.0)
    fresh = d.reserve_kv(prompts[1])  # an idle engine steps nothing: reserving expires the stale one
    assert list(d.scheduler.reserved) == [fresh["reservation_id"]]
    assert d.release_kv(fresh["reservation_id"]) and d.kv.num_free_blocks == free_d


def test_a_claimed_request_runs_past_a_request_the_cache_cannot_hold_yet(prompts, push_instances):
    """Reservations fill the pool; a plain request that does not fit waits (it is not aborted as too
    big while reservations hold blocks), a claimed one runs past it, and then the plain one fits."""
    p, d = push_instances
    free_d = d.kv.num_free_blocks
    big = [[t + i for t in range(100, 200)] for i in range(3)]  # 13 blocks each, 39 of the 40
    held = [d.reserve_kv(b) for b in big]
    kv = prefill_into(p, big[0], held[0])[-1].kv_transfer_params
    d.add_request([9] * 100, greedy(2), request_id="plain")
    assert d.step() == [] and d.scheduler.waiting, "the plain request waits"
    d.add_request(big[0], greedy(2), request_id="claimed", kv_transfer_params=kv)
    d.release_kv(held[1]["reservation_id"])  # P never came for these two
    d.release_kv(held[2]["reservation_id"])
    outs = {o.request_id: o for o in drain(d)}
    assert outs["claimed"].outputs[0].finish_reason == "length"
    assert outs["plain"].outputs[0].finish_reason == "length", "not aborted as too big for the cache"
    assert d.kv.num_free_blocks == free_d


def test_only_a_prefill_instance_takes_a_reservation(tiny, push_instances):
    from heterollm import LLM

    _, d = push_instances
    res = d.reserve_kv([5, 6, 7])
    mix = LLM(str(tiny), instance_role="MIX", **COMMON)
    try:
        for engine, words in ((mix.engine, "role is MIX; a PREFILL instance .* writes into it"),
                              (d, "role is DECODE; a PREFILL instance")):
            with pytest.raises(RequestRejected, match=words):
                engine.add_request([5, 6, 7], greedy(1), kv_transfer_params={**res})
    finally:
        mix.shutdown()
    assert d.release_kv(res["reservation_id"])


def test_a_pull_decode_instance_answers_a_reservation_with_its_mode(tiny):
    from heterollm import LLM

    d = LLM(str(tiny), instance_role="DECODE", kv_cache_transfer_mode="PULL", transfer_listen_port=free_port(),
            **COMMON)
    try:
        assert d.engine.reserve_kv([1, 2, 3]) == {"kv_cache_transfer_mode": "PULL"}
        assert not d.engine.scheduler.reserved
    finally:
        d.shutdown()


def test_consecutive_blocks_move_as_one_slice():
    from heterollm.kv_cache.pd import block_runs

    assert block_runs((4, 5, 6, 9, 10), (0, 1, 2, 3, 7)) == [(4, 0, 3), (9, 3, 1), (10, 7, 1)]
    assert block_runs((3, 2), (0, 1)) == [(3, 0, 1), (2, 1, 1)] and block_runs((), ()) == []


def test_dst_rotate_starts_each_rank_at_another_peer():
    from heterollm.kv_cache.pd import peer_order

    assert [peer_order([0, 1, 2, 3], r, False) for r in range(3)] == [[0, 1, 2, 3]] * 3
    assert [peer_order([0, 1, 2, 3], r, True) for r in range(5)] == [
        [0, 1, 2, 3], [1, 2, 3, 0], [2, 3, 0, 1], [3, 0, 1, 2], [0, 1, 2, 3]]
    assert peer_order([2, 3], 1, True) == [3, 2] and peer_order([], 1, True) == []


@pytest.mark.slow
@pytest.mark.parametrize("tp_p,tp_d,rotate", [(1, 2, False), (2, 1, True)])
def test_push_across_tensor_parallel_sizes(tiny, prompts, tp_p, tp_d, rotate):
    """Each PREFILL rank writes its own heads into whichever DECODE rank holds them."""
    from heterollm import LLM

    ref = LLM(str(tiny), **COMMON)
    want = [o.outputs[0].token_ids for o in ref.generate(prompts, greedy())]
    ref.shutdown()
    p = LLM(str(tiny), instance_role="PREFILL", transfer_listen_port=free_port(), tp_size=tp_p,
            kv_push_dst_rotate=rotate, **COMMON)
    d = LLM(str(tiny), instance_role="DECODE", transfer_listen_port=free_port(), tp_size=tp_d, **COMMON)
    try:
        free_d = d.engine.kv.num_free_blocks
        got = []
        for prompt in prompts:
            res = d.engine.reserve_kv(prompt)
            assert len(res["remote_ranks"]) == tp_d
            kv = prefill_into(p.engine, prompt, res)[-1].kv_transfer_params
            d.engine.add_request(prompt, greedy(), kv_transfer_params=kv)
            got.append(drain(d.engine)[-1].outputs[0].token_ids)
        assert got == want and d.engine.kv.num_free_blocks == free_d
    finally:
        p.shutdown()
        d.shutdown()
