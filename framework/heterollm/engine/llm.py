"""The offline API: `LLM(model=..., **flags).generate(...)`, `.chat(...)`, `.beam_search(...)`, and for
pooling launches `.embed(...)` and `.score(...)`."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from heterollm.config import load_config
from heterollm.config.checks import check_single_replica
from heterollm.engine.beam_search import (BeamSearch, BeamSearchOutput, BeamSearchParams, chosen_logprobs,
                                          run_beam_search)
from heterollm.engine.llm_engine import LLMEngine
from heterollm.engine.outputs import EmbeddingRequestOutput, RequestOutput, ScoringRequestOutput
from heterollm.interfaces import TokenLogprobs
from heterollm.model_executor.weight_update import WeightUpdate
from heterollm.multimodal.processor import split_images
from heterollm.pooling import PoolingParams
from heterollm.pooling.scoring import cosine, pair_ids, pair_up
from heterollm.sampling import SamplingParams
from heterollm.sampling.structured import GrammarState

Prompt = str | list[int] | dict[str, Any]


class LLM:
    """Keyword arguments are launch flags (any spelling the CLI accepts, e.g. `block_size=16`,
    `max_num_seqs=8`, `dtype="float32"`), validated exactly like the command line."""

    def __init__(self, model: str, **flags: Any) -> None:
        loaded = load_config([], overrides={"model": model, **flags})
        self.config = loaded.config
        check_single_replica(self.config, "the offline API")
        self.engine = LLMEngine(self.config)
        self._counter = 0

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer.hf

    def _default_params(self) -> SamplingParams:
        return SamplingParams(**self.engine.source.generation_defaults)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: SamplingParams |
                 Sequence[SamplingParams] | None = None, priority: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion in one continuous batch; outputs in input order.

        `prompts`: a string, a list of token ids, a dict with `prompt` or `prompt_token_ids`, or a
        list of those. `priority`: one per prompt, lower first (needs priority_strategy="priority").
        A bad prompt or parameter raises ValueError naming it before anything runs."""
        single = isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                      and isinstance(prompts[0], int))
        items = [prompts] if single else list(prompts)
        if sampling_params is None:
            params = [self._default_params() for _ in items]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(items)
        else:
            params = list(sampling_params)
            if len(params) != len(items):
                raise ValueError(f"sampling_params: {len(params)} given for {len(items)} prompts")
        priorities = list(priority) if priority is not None else [0] * len(items)
        if len(priorities) != len(items):
            raise ValueError(f"priority: {len(priorities)} given for {len(items)} prompts")
        encoded = [self._encode(p) for p in items]  # validate all (and load their images) before admitting any
        return self._run([(text, ids, sp) for (text, ids, _), sp in zip(encoded, params)], priorities,
                         mm_items=[mm for _, _, mm in encoded])

    def _encode(self, prompt: Prompt) -> tuple[str | None, list[int], list[Any] | None]:
        """(text, ids) of a prompt; a dict's `multi_modal_data` ({"image": [...]}: PIL images, bytes,
        data: or http(s) URLs; one `<|vision_start|><|image_pad|><|vision_end|>` per image in the prompt)
        is loaded and preprocessed here: (text, expanded ids, its items or None)."""
        text, ids = self.engine.tokenize_prompt(prompt, multimodal=True)
        if not (isinstance(prompt, dict) and prompt.get("multi_modal_data")):
            return text, ids, None
        ids, items = self.engine.multimodal.admit(ids, prompt["multi_modal_data"], prompt.get("mm_processor_kwargs"))
        return text, ids, items

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, **template_kwargs: Any) -> list[RequestOutput]:
        """Apply the model's chat template (or `chat_template`) to one conversation or a list of them."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        sp = sampling_params or self._default_params()
        batch, mm_items = [], []
        for conv in convs:
            conv, images = split_images(conv)
            # before the template, which may not render image parts
            self.engine.multimodal.refuse_if_text_only(images, "messages.image")
            ids = self.engine.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                            chat_template=chat_template, **template_kwargs)
            items = None
            if images:
                ids, items = self.engine.multimodal.admit(ids, {"image": images}, field="messages")
            batch.append((None, ids, sp))
            mm_items.append(items)
        return self._run(batch, mm_items=mm_items)

    def beam_search(self, prompts: Prompt | Sequence[Prompt], params: BeamSearchParams) -> list[BeamSearchOutput]:
        """Beam search (vLLM's `LLM.beam_search`): per prompt, the best `params.beam_width` sequences,
        best first. Every round runs one one-token request per live beam of every prompt in one
        continuous batch (see heterollm.engine.beam_search). A prompt that leaves no room for
        `max_tokens` raises ValueError naming max_tokens before anything runs."""
        items = [prompts] if _is_single_prompt(prompts) else list(prompts)
        encoded = [self.engine.tokenize_prompt(p)[1] for p in items]
        for ids in encoded:
            if len(ids) + params.max_tokens > self.engine.max_model_len:
                raise ValueError(f"max_tokens: a prompt of {len(ids)} tokens + max_tokens={params.max_tokens} is "
                                 f"more than max_model_len={self.engine.max_model_len}")
        search = BeamSearch(encoded, params, self.engine.eos_token_ids)
        step = params.step_params()

        def run_round(token_id_lists: list[list[int]]) -> list[TokenLogprobs]:
            outs = self._run([(None, ids, step) for ids in token_id_lists])
            return [chosen_logprobs(out) for out in outs]

        run_beam_search(search, run_round)
        return search.outputs(lambda ids: self.engine.tokenizer.decode(ids, skip_special_tokens=True))

    def embed(self, prompts: Prompt | Sequence[Prompt],
              pooling_params: PoolingParams | None = None) -> list[EmbeddingRequestOutput]:
        """Embeddings of every prompt in one continuous batch (a launch with task="embed", FastDeploy's
        runner="pooling"); outputs in input order. `pooling_params`: `dimensions` (Matryoshka),
        `normalize`, `pooling_type` (LAST, MEAN, CLS) over the launch's defaults. A launch that
        cannot embed raises ValueError naming --task."""
        params = pooling_params or PoolingParams()
        self.engine.pooling.resolve(params)  # refuse before anything runs
        items = [prompts] if _is_single_prompt(prompts) else list(prompts)
        encoded = [self.engine.tokenize_prompt(p) for p in items]
        outs = self._run([(text, ids, None) for text, ids in encoded], pooling=params)
        return [EmbeddingRequestOutput(o.request_id, o.prompt_token_ids, o.pooled.tolist()) for o in outs]

    def score(self, text_1: str | Sequence[str], text_2: str | Sequence[str],
              instruction: str | None = None) -> list[ScoringRequestOutput]:
        """Relevance scores of text pairs, vLLM's pairing (one text_1 against each text_2, or two lists
        zipped): Qwen3-Reranker's P("yes") (enable_qwen3_reranker; `instruction` replaces its
        default one), a one-label cross-encoder's sigmoid, or the cosine of two embeddings (task="embed")."""
        pairs = pair_up(text_1 if isinstance(text_1, str) else list(text_1),
                        text_2 if isinstance(text_2, str) else list(text_2))
        setup = self.engine.pooling
        if setup.scores_by_model:
            params = setup.resolve(PoolingParams(task="score"))
            batch = [(None, pair_ids(setup, self.get_tokenizer(), a, b, instruction), None) for a, b in pairs]
            return [ScoringRequestOutput(o.request_id, o.prompt_token_ids, float(o.pooled[0]))
                    for o in self._run(batch, pooling=params)]
        setup.resolve(PoolingParams(task="score"))  # refuses a launch that cannot score
        texts = [t for pair in pairs for t in pair]
        vectors = self.embed(texts)
        return [ScoringRequestOutput(vectors[2 * i].request_id, vectors[2 * i].prompt_token_ids + vectors[2 * i + 1]
                                     .prompt_token_ids, cosine(torch.tensor(vectors[2 * i].embedding),
                                                               torch.tensor(vectors[2 * i + 1].embedding)))
                for i in range(len(pairs))]

    def _run(self, batch: list[tuple[str | None, list[int], SamplingParams | None]],
             priorities: list[int] | None = None, pooling: PoolingParams | None = None,
             mm_items: list[Any] | None = None) -> list[RequestOutput]:
        self._compile_grammars([sp for _, _, sp in batch if sp is not None])
        order = []
        try:
            for i, (text, ids, sp) in enumerate(batch):
                self._counter += 1
                rid = f"offline-{self._counter}"
                self.engine.add_request(text if text is not None else ids, sp, request_id=rid, prompt_token_ids=ids,
                                        priority=priorities[i] if priorities else 0, pooling=pooling,
                                        mm_items=mm_items[i] if mm_items else None)
                order.append(rid)
        except Exception:
            for rid in order:
                self.engine.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        pending = set(order)
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
            if pending and not self.engine.has_unfinished():
                raise RuntimeError(f"requests {sorted(pending)} ended without output")
        return [done[rid] for rid in order]

    def _compile_grammars(self, params: list[SamplingParams]) -> None:
        """Compile every structured output constraint before admitting anything: one that does not
        compile raises StructuredOutputError (a ValueError) naming the field."""
        states = [GrammarState(self.engine.compile_grammar(sp.structured_outputs), sp.structured_outputs)
                  for sp in params if sp.structured_outputs is not None]
        for state in states:
            state.result()

    def update_weights(self, path: str | None = None, payload: bytes | None = None) -> dict[str, float]:
        """Replace the weights (needs dynamic_load_weight=1): from `path` (a folder of *.safetensors or
        one file) or `payload` (a safetensors file's bytes, possibly only the parameters that changed).
        All or nothing; the prefix cache is emptied. Returns {"tensors", "seconds"}."""
        return self.engine.update_weights(WeightUpdate(path=path, payload=payload))

    def start_profile(self) -> None:
        """Start the online profiler on every rank (needs enable_online_profile=True); the steps run
        until `stop_profile` are recorded."""
        self.engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stop it; the trace files written, one per rank (in profile_dir; open them in Perfetto)."""
        return self.engine.stop_profile()

    def shutdown(self) -> None:
        self.engine.shutdown()


def _is_single_prompt(prompts: Any) -> bool:
    return isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and bool(prompts)
                                                 and isinstance(prompts[0], int))
