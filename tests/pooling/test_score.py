"""LLM.score against transformers: Qwen3-Reranker's P("yes") over {"no", "yes"} at the template's last
position (a tiny random Qwen3 causal LM with enable_qwen3_reranker), a one-label
Qwen3ForSequenceClassification cross-encoder's sigmoid, and the cosine of embeddings (task="embed")."""
from __future__ import annotations

import functools

import pytest
import torch

from helpers import RERANKER_INSTRUCTION, build_tiny_model, hf_reranker_score
from heterollm import LLM

QUERY = "What is the capital of China?"
DOCS = ["The capital of China is Beijing.", "Gravity pulls things down.", "Beijing is in the north of China."]
FLAGS = {"dtype": "float32", "block_size": 8, "num_gpu_blocks_override": 128, "max_model_len": 256}


@functools.lru_cache(maxsize=4)
def hf_model(folder: str, kind: str):
    import transformers
    cls = transformers.AutoModelForCausalLM if kind == "lm" else transformers.AutoModelForSequenceClassification
    return cls.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reranker_folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("reranker"), "qwen3")


@pytest.fixture(scope="module")
def reranker(reranker_folder):
    llm = LLM(str(reranker_folder), enable_qwen3_reranker=True, **FLAGS)
    yield llm
    llm.shutdown()


def test_qwen3_reranker_scores_equal_transformers(reranker, reranker_folder):
    outs = reranker.score(QUERY, DOCS)
    want = [hf_reranker_score(reranker_folder, QUERY, d) for d in DOCS]
    assert [o.score for o in outs] == pytest.approx(want, abs=1e-5)
    assert len({round(o.score, 6) for o in outs}) == 3  # the documents score differently
    zipped = reranker.score([QUERY, "Who wrote Hamlet?"], DOCS[:2], instruction="Judge relevance")
    assert [o.score for o in zipped] == pytest.approx(
        [hf_reranker_score(reranker_folder, QUERY, DOCS[0], "Judge relevance"),
         hf_reranker_score(reranker_folder, "Who wrote Hamlet?", DOCS[1], "Judge relevance")], abs=1e-5)


def test_a_preformatted_query_is_used_as_is(reranker, reranker_folder):
    """vLLM's Qwen3-Reranker examples format the template on the client: the same score."""
    from helpers import _RERANKER_PREFIX, _RERANKER_SUFFIX
    query = f"{_RERANKER_PREFIX}<Instruct>: {RERANKER_INSTRUCTION}\n<Query>: {QUERY}\n"
    doc = f"<Document>: {DOCS[0]}{_RERANKER_SUFFIX}"
    assert reranker.score(query, doc)[0].score == pytest.approx(hf_reranker_score(reranker_folder, QUERY, DOCS[0]),
                                                                abs=1e-5)


def test_a_reranker_launch_still_generates(reranker):
    assert reranker.generate([1, 2, 3])[0].outputs[0].token_ids


def test_cross_encoder_scores_equal_transformers(tmp_path):
    folder = build_tiny_model(tmp_path / "cls", "qwen3", head="classification")
    llm = LLM(str(folder), **FLAGS)
    try:
        outs = llm.score(QUERY, DOCS)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(folder)
        for doc, out in zip(DOCS, outs):
            ids = tok(QUERY, doc)["input_ids"]
            assert out.prompt_token_ids == ids
            with torch.no_grad():
                logit = hf_model(str(folder), "cls")(torch.tensor([ids])).logits[0, 0]
            assert out.score == pytest.approx(logit.sigmoid().item(), abs=1e-5)
        with pytest.raises(ValueError, match="classification head"):
            llm.generate([1, 2, 3])
    finally:
        llm.shutdown()


def test_embedding_launch_scores_by_cosine(reranker_folder):
    llm = LLM(str(reranker_folder), task="embed", **FLAGS)
    try:
        out = llm.score(QUERY, DOCS[0])[0]
        a, b = llm.embed([QUERY, DOCS[0]])
        assert out.score == pytest.approx(torch.nn.functional.cosine_similarity(
            torch.tensor(a.embedding), torch.tensor(b.embedding), dim=0).item(), abs=1e-6)
    finally:
        llm.shutdown()


def test_a_generate_launch_cannot_score(reranker_folder):
    llm = LLM(str(reranker_folder), **FLAGS)
    try:
        with pytest.raises(ValueError, match="--enable_qwen3_reranker"):
            llm.score(QUERY, DOCS)
    finally:
        llm.shutdown()


@pytest.mark.parametrize("flags, needle", [
    ({"enable_qwen3_reranker": True, "family": "llama"}, "Qwen3-Reranker checkpoints are"),
    ({"task": "mm_embed"}, "multimodal"),
    ({"runner": "generate", "task": "embed"}, "disagree"),
    ({"pooler_config": '{"pooling": "MEAN"}'}, "unknown key"),
])
def test_launch_refusals_name_the_flag(tmp_path, flags, needle):
    from heterollm.config import ConfigError
    from heterollm.plugins.resolver import LaunchError
    family = flags.pop("family", "qwen3")
    folder = build_tiny_model(tmp_path / family, family)
    with pytest.raises((ConfigError, LaunchError), match=needle):
        LLM(str(folder), **FLAGS, **flags)
