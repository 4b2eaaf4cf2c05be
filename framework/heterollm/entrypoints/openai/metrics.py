"""Prometheus metrics of one server (its own registry, so tests can run several)."""
from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from heterollm.engine.outputs import RequestOutput

_LATENCY = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_PER_TOKEN = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)


class ServerMetrics:
    """Request counters and histograms over the whole server; engine gauges and prefix cache
    counters per engine replica (label dp_rank, one replica per --dp_size)."""

    def __init__(self, replicas: list[Any], model_name: str) -> None:
        """`replicas`: objects with `stats()` (AsyncEngine, EngineCoreClient); the list may be filled
        after this returns (it is read at each scrape)."""
        r = self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        self.requests = Counter("heterollm_requests", "Requests that finished, by finish reason.",
                                labels + ["finish_reason"], registry=r)
        self.errors = Counter("heterollm_request_errors", "Requests refused or failed, by HTTP status.",
                              labels + ["status"], registry=r)
        self.prompt_tokens = Counter("heterollm_prompt_tokens", "Prompt tokens of finished requests.", labels,
                                     registry=r)
        self.generation_tokens = Counter("heterollm_generation_tokens", "Generated tokens of finished requests.",
                                         labels, registry=r)
        self.aborts = Counter("heterollm_request_aborts", "Requests aborted before they finished (the client went "
                              "away, or its answer could not be delivered).", labels, registry=r)
        self.ttft_slo_missed = Counter("heterollm_ttft_slo_missed", "Finished requests that asked for a first "
                                       "token within ttft_slo_ms and got it later.", labels, registry=r)
        self.preemptions = Counter("heterollm_num_preemptions", "Preemptions (recompute) of finished requests.",
                                   labels, registry=r)
        self.ttft = Histogram("heterollm_time_to_first_token_seconds", "Arrival to first generated token.",
                              labels, buckets=_LATENCY, registry=r)
        self.tpot = Histogram("heterollm_time_per_output_token_seconds", "Mean time per output token after "
                              "the first.", labels, buckets=_PER_TOKEN, registry=r)
        self.e2e = Histogram("heterollm_e2e_request_latency_seconds", "Arrival to the last token.", labels,
                             buckets=_LATENCY, registry=r)
        for metric in (self.aborts, self.ttft_slo_missed, self.prompt_tokens, self.generation_tokens, self.preemptions, self.ttft, self.tpot,
                       self.e2e):
            metric.labels(model_name)  # exported as 0 from the start, so rates work before the first request
        r.register(_ReplicaCollector(replicas, model_name))
        self.in_flight = Gauge("heterollm_http_requests_in_flight", "Generation requests the server is handling.",
                               registry=r)

    def record_finished(self, out: RequestOutput) -> None:
        """Called on the engine thread with each finished request's final output."""
        m, name = out.metrics, self.model_name
        for c in out.outputs:
            self.requests.labels(name, c.finish_reason or "unknown").inc()
        self.prompt_tokens.labels(name).inc(m.num_prompt_tokens)
        self.generation_tokens.labels(name).inc(m.num_generated_tokens)
        self.preemptions.labels(name).inc(m.num_preemptions)
        if m.ttft_slo_missed:
            self.ttft_slo_missed.labels(name).inc()
        if m.ttft is not None:
            self.ttft.labels(name).observe(m.ttft)
        if m.tpot is not None:
            self.tpot.labels(name).observe(m.tpot)
        if m.finished_time is not None:
            self.e2e.labels(name).observe(m.finished_time - m.arrival_time)

    def record_abort(self, _request_id: str) -> None:
        self.aborts.labels(self.model_name).inc()

    def record_error(self, status: int) -> None:
        self.errors.labels(self.model_name, str(status)).inc()


_GAUGES = {  # name: (help, LLMEngine.stats key or a function of the stats)
    "heterollm_num_requests_running": ("Sequences being computed (n > 1 counts each).", "running"),
    "heterollm_num_requests_waiting": ("Sequences waiting for admission to a batch.", "waiting"),
    "heterollm_kv_cache_usage_perc": ("Fraction of KV cache blocks in use (0..1).", "kv_usage"),
    "heterollm_kv_cache_free_blocks": ("KV cache blocks free.", "kv_free_blocks"),
    "heterollm_kv_cache_total_blocks": ("KV cache blocks in all.", "kv_total_blocks"),
    "heterollm_kv_cache_reserved_bytes": ("KV cache bytes the replica reserved, over its tensor-parallel ranks (see "
                                          "the start-up log for the host budget).", "kv_reserved_bytes"),
    "heterollm_kv_cache_committed_bytes": ("KV cache bytes actually backed by memory: on CPU, blocks ever handed out "
                                           "x bytes per block (pages are committed on first write); elsewhere "
                                           "the whole reservation.", "kv_committed_bytes"),
    "heterollm_prefix_cache_hit_rate": ("Prefix cache hits / queries since start (0..1).",
                                        lambda s: s["prefix_hits"] / s["prefix_queries"] if s["prefix_queries"]
                                        else 0.0),
    "heterollm_prefix_cache_blocks": ("KV cache blocks holding a cached prefix (in use or evictable).",
                                      "prefix_cached_blocks"),
    "heterollm_host_tier_blocks": ("Host KV tier slots (--host_blocks_factor / --swap_space; 0 without one).",
                                   "host_tier_blocks"),
    "heterollm_host_tier_cached_blocks": ("Host KV tier slots holding a cached prefix block.",
                                          "host_tier_cached_blocks"),
    "heterollm_kv_reservations": ("PD PUSH, DECODE: block reservations waiting for a prefill instance's K/V.",
                                  "kv_reservations"),
    "heterollm_kv_moving_requests": ("PD: requests whose K/V is moving now (pulled in by a DECODE instance, pushed "
                                     "out by a PREFILL one); their blocks stay taken until the move ended.",
                                     "kv_moving"),
    "heterollm_spec_decode_acceptance_rate": ("Speculative decoding: accepted drafts / verified drafts since start "
                                              "(0 when off or before the first draft).", "spec_acceptance_rate"),
    "heterollm_spec_decode_mean_accepted_length": ("Speculative decoding: tokens a verification emits on average "
                                                   "(accepted drafts + the target's own; 0 when off).",
                                                   "spec_mean_accepted_length"),
}
_COUNTERS = {
    "heterollm_prefix_cache_queries": ("Prompt tokens looked up in the prefix cache.", "prefix_queries"),
    "heterollm_prefix_cache_hits": ("Prompt tokens found in the prefix cache.", "prefix_hits"),
    "heterollm_prefix_cache_host_hits": ("Of the prefix cache hits, tokens found in the host KV tier (copied back).",
                                         "prefix_host_hits"),
    "heterollm_host_tier_saved_blocks": ("Blocks the device pool evicted into the host KV tier.", "host_tier_saved"),
    "heterollm_host_tier_loaded_blocks": ("Blocks copied back from the host KV tier.", "host_tier_loaded"),
    "heterollm_prefix_cache_store_hits": ("Of the prefix cache hits, tokens fetched from the KV cache store.",
                                          "prefix_store_hits"),
    "heterollm_kv_store_put_blocks": ("Blocks handed to the ranks to put in the KV cache store.", "store_put_blocks"),
    "heterollm_kv_store_fetched_blocks": ("Blocks fetched from the KV cache store.", "store_fetched_blocks"),
    "heterollm_kv_pull_blocks": ("PD, DECODE: KV blocks pulled from prefill instances.", "kv_pull_blocks"),
    "heterollm_kv_pull_seconds": ("PD, DECODE: seconds the pulls took, summed over requests (each from the step "
                                  "that started it to the step that saw it end).", "kv_pull_seconds"),
    "heterollm_kv_push_blocks": ("PD PUSH, PREFILL: KV blocks written into decode instances' reservations.",
                                 "kv_push_blocks"),
    "heterollm_kv_push_seconds": ("PD PUSH, PREFILL: seconds the answers waited for their pushes, summed over "
                                  "requests (each from the end of its prompt's last forward, beside which its "
                                  "layers were pushed, to the step that saw the writes end).", "kv_push_seconds"),
    "heterollm_spec_decode_num_drafts": ("Speculative decoding: verifications (a sequence's step with drafts).",
                                         "spec_num_drafts"),
    "heterollm_spec_decode_num_draft_tokens": ("Speculative decoding: draft tokens verified.",
                                               "spec_num_draft_tokens"),
    "heterollm_spec_decode_num_accepted_tokens": ("Speculative decoding: draft tokens accepted.",
                                                  "spec_num_accepted_tokens"),
}


class _ReplicaCollector:
    """Each engine replica's gauges and prefix cache counters (tokens, as vLLM counts), read at scrape
    time from `replica.stats()` (the engine's own, or the last an engine-core process sent), labelled
    with the replica's dp_rank."""

    def __init__(self, replicas: list[Any], model_name: str) -> None:
        self.replicas, self.model_name = replicas, model_name

    def collect(self):
        labels = ["model_name", "dp_rank"]
        stats = [replica.stats() for replica in self.replicas]
        for table, family in ((_GAUGES, GaugeMetricFamily), (_COUNTERS, CounterMetricFamily)):
            for name, (doc, read) in table.items():
                metric = family(name, doc, labels=labels)
                for rank, s in enumerate(stats):
                    metric.add_metric([self.model_name, str(rank)], read(s) if callable(read) else s[read])
                yield metric
        per_pos = CounterMetricFamily("heterollm_spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: "
                                      "verifications whose draft at this position (0-based) was accepted.",
                                      labels=[*labels, "position"])
        for rank, s in enumerate(stats):
            for pos, count in enumerate(s["spec_accepted_per_position"]):
                per_pos.add_metric([self.model_name, str(rank), str(pos)], count)
        yield per_pos
        yield from _expert_load(stats, self.model_name)


def _expert_load(stats: list[dict[str, Any]], model_name: str):
    """--enable_eplb: tokens per logical expert and per physical replica slot, each sparse layer's rank
    imbalance since its last re-placement, and the re-placements so far (families with no sample when
    EPLB is off)."""
    labels = ["model_name", "dp_rank", "layer"]
    load = CounterMetricFamily("heterollm_moe_expert_load", "Expert choices routed to each logical expert.",
                               labels=[*labels, "expert"])
    replica = CounterMetricFamily("heterollm_moe_expert_replica_load", "Expert choices each physical expert slot "
                                  "served (EPLB's redundant replicas included).", labels=[*labels, "ep_rank", "slot",
                                                                                          "expert"])
    ratio = GaugeMetricFamily("heterollm_eplb_rank_load_ratio", "Max over mean of the expert-parallel ranks' "
                              "choices since the layer's last re-placement (1: balanced).", labels=labels)
    moves = CounterMetricFamily("heterollm_eplb_rebalances", "EPLB re-placements so far.", labels=labels[:2])
    for rank, s in enumerate(stats):
        moe = s.get("moe")
        if not moe:
            continue
        base = [model_name, str(rank)]
        moves.add_metric(base, moe["rebalances"])
        for layer, experts, slots, placement, ranks in zip(moe["layers"], moe["expert"], moe["replica"],
                                                           moe["placement"], moe["rank_window"]):
            for e, count in enumerate(experts):
                load.add_metric([*base, str(layer), str(e)], count)
            per_rank = len(slots) // len(ranks)
            for p, (count, e) in enumerate(zip(slots, placement)):
                replica.add_metric([*base, str(layer), str(p // per_rank), str(p % per_rank), str(e)], count)
            mean = sum(ranks) / len(ranks)
            ratio.add_metric([*base, str(layer)], max(ranks) / mean if mean else 1.0)
    yield from (load, replica, ratio, moves)
