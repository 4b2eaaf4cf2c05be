"""The draft-model proposer: a small model with the target's vocabulary, run on every worker beside
the target (tensor-parallel like it), with its own paged KV cache addressed by the target's block
tables.

Lockstep: every step the draft computes the same positions the target kept — a prefill chunk, or
a decode's input and the drafts the target accepted — plus the token the target just sampled, so
its cache is valid wherever the target's is (prefix-cache hits included: whoever computed a cached
block computed the draft's half of it too). The row of that sampled token gives the first draft;
each further draft is one more single-token forward. Drafts are written into the KV slots after
the sequence's end, which the scheduler allocates with the step (`SpecConfig.lookahead`); a
sequence whose table has no such slots (a full cache) gets fewer or no drafts.
"""
from __future__ import annotations

import logging
import zlib
from typing import TYPE_CHECKING, Any

import torch

from heterollm.config import ConfigError
from heterollm.interfaces import AttentionInputs, ForwardContext, ScheduledRequest, StepInputs
from heterollm.model_executor.checkpoint_slice import ReadStats
from heterollm.model_executor.linear_method import model_bytes, prepare_linears, select_linear_method
from heterollm.model_executor.loader import iter_weights, resolve_model
from heterollm.plugins.registry import get_registry
from heterollm.plugins.resolver import resolve_model as resolve_model_class
from heterollm.sampling.sampler import Sampler, SamplingRow, draw, sampling_probs
from heterollm.spec_decode.config import SpecConfig

if TYPE_CHECKING:
    from heterollm.model_executor.runner import ModelRunner

logger = logging.getLogger("heterollm.spec_decode")


def _flag(spec: SpecConfig) -> str:
    return "--draft_model" if spec.source == "--num_speculative_tokens" else "--speculative_config: model"


def load_draft_source(spec: SpecConfig, target_hf: Any) -> Any:
    """The draft checkpoint, checked against the target: the same vocabulary (ConfigError naming the flag)."""
    try:
        source = resolve_model(spec.draft_model)
    except ConfigError as exc:
        raise ConfigError(str(exc).replace("--model", _flag(spec), 1)) from None
    theirs, ours = getattr(source.hf_config, "vocab_size", None), getattr(target_hf, "vocab_size", None)
    if theirs != ours:
        raise ConfigError(f"{_flag(spec)}: {spec.draft_model} has a vocabulary of {theirs} tokens, the target "
                          f"model {ours}; a draft model must share the target's tokenizer")
    return source


class DraftModel:
    def __init__(self, runner: ModelRunner, spec: SpecConfig) -> None:
        self.runner = runner
        self.spec = spec
        self.k = spec.num_speculative_tokens
        self.model: Any = None
        self.kv_caches: list[torch.Tensor] = []
        self.weight_bytes = 0
        self.probs: dict[str, tuple[list[int], torch.Tensor]] = {}
        """--enable_probabilistic_draft: per request, its last drafts and the distributions they were drawn from."""

    # -- set-up ----------------------------------------------------------------------------
    def load(self) -> None:
        r = self.runner
        source = load_draft_source(self.spec, r.source.hf_config)
        sel = r.launch.selection
        entry = resolve_model_class(get_registry(), source.architectures,
                                    [f for f in (sel.family, r.platform.default_impl) if f], r.platform.name)
        if entry is None:
            raise ConfigError(f"{_flag(self.spec)}: {self.spec.draft_model} has architecture "
                              f"{source.architectures or '(none)'}, which heterollm does not support")
        with torch.device(r.device):
            previous = torch.get_default_dtype()
            torch.set_default_dtype(r.dtype)
            try:
                model = entry.obj(source.hf_config, r.pctx, r.launch.max_model_len)
            except ValueError as exc:
                raise ConfigError(f"{_flag(self.spec)}: {self.spec.draft_model}: {exc}") from None
            finally:
                torch.set_default_dtype(previous)
        expected = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        try:
            loaded = model.load_weights(iter_weights(source, r.config.fastdeploy.load_choices, ReadStats()))
        except (KeyError, ValueError) as exc:
            raise ConfigError(f"{_flag(self.spec)}: {self.spec.draft_model}: {exc}") from None
        if expected - loaded:
            raise ConfigError(f"{_flag(self.spec)}: {self.spec.draft_model} is missing weights: "
                              f"{', '.join(sorted(expected - loaded)[:4])}")
        prepare_linears(model, select_linear_method(None))
        self.model = model.eval()
        self.weight_bytes = model_bytes(model)
        logger.info("draft model %s (%s, %.1f MiB) proposes %d tokens per step%s", type(model).__name__,
                    self.spec.draft_model, self.weight_bytes / 2**20, self.k,
                    " (sampled: --enable_probabilistic_draft)" if self.spec.probabilistic else " (greedy)")

    def kv_bytes_per_block(self) -> int:
        return self.runner.cache_layout(self.model, 1).bytes_per_block

    def initialize_cache(self, num_blocks: int) -> None:
        layout = self.runner.cache_layout(self.model, num_blocks)
        self.kv_caches = [torch.empty(layout.shape, dtype=layout.dtype, device=self.runner.device)
                          for _ in range(layout.num_layers)]

    # -- one step --------------------------------------------------------------------------
    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.probs.pop(rid, None)

    def draft_probs(self, request_id: str, drafts: list[int]) -> torch.Tensor | None:
        """The distributions `drafts` were drawn from (None: drawn greedily, a one-hot q)."""
        kept = self.probs.get(request_id)
        if kept is None or kept[0][:len(drafts)] != drafts:
            return None
        return kept[1][:len(drafts)]

    def _forward(self, ids: list[int], positions: list[int], query_lens: list[int], context_lens: list[int],
                 tables: list[list[int]]) -> torch.Tensor:
        r = self.runner
        bs = r.block_size
        inputs = AttentionInputs(query_lens=query_lens, context_lens=context_lens,
                                 block_tables=[t[:-(-(c + q) // bs)] for t, c, q in zip(tables, context_lens, query_lens)],
                                 block_size=bs)
        ctx = ForwardContext(r.attn_backend, r.attn_backend.build_metadata(inputs, r.device), self.kv_caches)
        step = StepInputs(torch.tensor(ids, device=r.device), torch.tensor(positions, device=r.device), ctx)
        return self.model(step.input_ids, step.positions, step.ctx)

    def _next(self, logits: torch.Tensor, reqs: list[ScheduledRequest]) -> tuple[list[int], torch.Tensor | None]:
        """One draft per row: argmax, or (probabilistic) a draw from the request's sampling distribution."""
        # the request's own logits processors and penalties (allowed tokens, bad words, bias): a draft
        # the target may not take is never worth proposing
        rows = [SamplingRow(r.sampling.params, None, r.prompt_token_ids, r.output_token_ids) for r in reqs]
        logits, _ = Sampler.prepare(logits, rows)
        tokens = logits.argmax(-1)
        if not self.spec.probabilistic:
            return tokens.tolist(), None
        params = [r.sampling.params for r in reqs]
        probs = sampling_probs(logits, params)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            idx = torch.tensor(sampled, device=logits.device)
            tokens[idx] = draw(probs[idx], [self._generator(reqs[i]) for i in sampled])
        return tokens.tolist(), probs

    def _generator(self, r: ScheduledRequest) -> torch.Generator | None:
        return self.runner._generator(r)

    @torch.inference_mode()
    def propose(self, reqs: list[ScheduledRequest], sampled: list[list[int]]) -> list[list[int]]:
        """Run the draft over this step's kept tokens and draft for every request that sampled one;
        per request, its drafts ([] for none)."""
        bs = self.runner.block_size
        ids: list[int] = []
        positions: list[int] = []
        qlens: list[int] = []
        ctxs: list[int] = []
        tables: list[list[int]] = []
        drafting: list[tuple[int, int, int]] = []  # (request index, position of its sampled token, drafts to make)
        rows: list[int] = []  # the sampled token's row in this forward, per drafting request
        for i, r in enumerate(reqs):
            kept = len(r.new_token_ids) - r.num_spec_tokens + max(len(sampled[i]) - 1, 0)
            tokens = r.new_token_ids[:kept]
            start = r.num_computed_tokens
            p = r.sampling.params
            n = 0
            if sampled[i] and r.pooling is None and p.structured_outputs is None:
                last = start + kept  # the sampled token's position
                left = (p.max_tokens or 1 << 30) - len(r.output_token_ids) - len(sampled[i])
                n = min(self.k, len(r.block_ids) * bs - last, left)
            if n > 0:
                tokens = tokens + [sampled[i][-1]]
            if not tokens:
                continue
            ids += tokens
            positions += range(start, start + len(tokens))
            qlens.append(len(tokens))
            ctxs.append(start)
            tables.append(r.block_ids)
            if n > 0:
                drafting.append((i, start + len(tokens) - 1, n))
                rows.append(len(ids) - 1)
        if not ids:
            return [[] for _ in reqs]
        hidden = self._forward(ids, positions, qlens, ctxs, tables)
        out: list[list[int]] = [[] for _ in reqs]
        if not drafting:
            return out
        dreqs = [reqs[i] for i, _, _ in drafting]
        tokens, probs = self._next(self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)]), dreqs)
        kept_probs: list[list[torch.Tensor]] = [[] for _ in drafting]
        for j, (i, _, _) in enumerate(drafting):
            out[i].append(tokens[j])
            if probs is not None:
                kept_probs[j].append(probs[j])
        for step in range(1, self.k):
            live = [j for j, (_, _, n) in enumerate(drafting) if n > step]
            if not live:
                break
            pos = [drafting[j][1] + step for j in live]
            hidden = self._forward([out[drafting[j][0]][-1] for j in live], pos, [1] * len(live), pos,
                                   [reqs[drafting[j][0]].block_ids for j in live])
            tokens, probs = self._next(self.model.compute_logits(hidden), [dreqs[j] for j in live])
            for n, j in enumerate(live):
                out[drafting[j][0]].append(tokens[n])
                if probs is not None:
                    kept_probs[j].append(probs[n])
        if self.spec.probabilistic:
            for j, (i, _, _) in enumerate(drafting):
                self.probs[reqs[i].request_id] = (out[i], torch.stack(kept_probs[j]))
        return out


def rank_seed(request_id: str) -> int:
    """A seed every tensor-parallel rank derives alike from the request id (its drafts feed a sharded
    forward, so every rank must draw the same ones)."""
    return zlib.crc32(request_id.encode())
