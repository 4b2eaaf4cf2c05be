"""Engine behaviour on a tiny model: stops, streaming, seeds, n, admission errors, model errors."""
from __future__ import annotations

import json
import shutil

import pytest

from helpers import ADMIT_ALL, build_tiny_model
from heterollm import LLM, SamplingParams
from heterollm.config import ConfigError
from heterollm.scheduler.request import RequestRejected
from heterollm.tokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(str(tiny), dtype="float32", block_size=8, num_gpu_blocks_override=256, max_model_len=128)


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def test_text_prompts_and_metrics(llm):
    [out] = llm.generate("Hello there", GREEDY)
    c = out.outputs[0]
    assert len(c.token_ids) == 24 and c.finish_reason == "length"
    assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
    assert out.metrics.ttft is not None and out.metrics.ttft >= 0 and out.metrics.tpot is not None
    assert out.prompt_token_ids == llm.get_tokenizer().encode("Hello there")


def test_stop_string_truncates_and_never_leaks(llm):
    [base] = llm.generate("Once upon a time", GREEDY)
    text = base.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert len(stop.strip()) >= 1
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop])
    [out] = llm.generate("Once upon a time", p)
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == stop
    assert c.text == text[: text.index(stop)]
    assert stop not in c.text
    p2 = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=[stop], include_stop_str_in_output=True)
    assert llm.generate("Once upon a time", p2)[0].outputs[0].text == text[: text.index(stop) + len(stop)]


def test_streaming_deltas_hold_back_stop_prefixes(llm):
    [base] = llm.generate("Once upon a time", GREEDY)
    text = base.outputs[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    engine = llm.engine
    rid = engine.add_request("Once upon a time", SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                                stop=[stop]))
    pieces, final = [], None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid:
                pieces.append(out.outputs[0].delta_text)
                assert stop not in "".join(pieces)
                final = out
    assert final.finished and "".join(pieces) == final.outputs[0].text


def test_stop_token_ids(llm):
    [base] = llm.generate([5, 6, 7], GREEDY)
    target = base.outputs[0].token_ids[5]
    [out] = llm.generate([5, 6, 7], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True,
                                                   stop_token_ids=[target]))
    first = base.outputs[0].token_ids.index(target)
    assert out.outputs[0].token_ids == base.outputs[0].token_ids[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == target


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.tokenizer.hf.eos_token_id
    [base] = llm.generate([9, 10], GREEDY)
    # force an EOS by declaring the 3rd greedy token an EOS id of this engine
    llm.engine.eos_token_ids.add(base.outputs[0].token_ids[2])
    try:
        [out] = llm.generate([9, 10], SamplingParams(max_tokens=24, temperature=0))
        assert out.outputs[0].finish_reason == "stop" and len(out.outputs[0].token_ids) <= 3
        [out2] = llm.generate([9, 10], GREEDY)
        assert len(out2.outputs[0].token_ids) == 24
    finally:
        llm.engine.eos_token_ids.discard(base.outputs[0].token_ids[2])
        llm.engine.eos_token_ids.add(eos)


def test_seed_reproducible_regardless_of_batch(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    alone = llm.generate("The weather", p)[0].outputs[0].token_ids
    batch = llm.generate(["The weather", "Other prompt", [3, 4, 5]],
                         [p, SamplingParams(max_tokens=5, temperature=1.0), GREEDY])
    assert batch[0].outputs[0].token_ids == alone
    other = llm.generate("The weather", SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99))
    assert other[0].outputs[0].token_ids != alone


def test_n_completions(llm):
    [out] = llm.generate("Hi", SamplingParams(n=3, max_tokens=8, temperature=1.0, seed=5))
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 or c.finish_reason == "stop" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1


def test_too_long_prompt_rejected_alone(llm):
    engine = llm.engine
    good = engine.add_request([1, 2, 3], GREEDY)
    with pytest.raises(RequestRejected, match="max_model_len") as info:
        engine.add_request(list(range(1, 200)), GREEDY)
    assert info.value.field == "prompt"
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done[good].outputs[0].finish_reason == "length"


def test_bad_token_ids_and_empty_prompt(llm):
    with pytest.raises(RequestRejected, match="outside the vocabulary"):
        llm.generate([[1, 10**9]], GREEDY)
    with pytest.raises(RequestRejected, match="empty"):
        llm.engine.add_request([], GREEDY)
    for prompt in ([1, "x"], [True, 2], 3.5):  # not token ids (a bool is no token id either)
        with pytest.raises(RequestRejected) as exc:
            llm.engine.add_request(prompt, GREEDY)
        assert exc.value.field == "prompt" and str(exc.value).endswith("must be a string or a list of token ids")


def test_max_model_len_finishes_with_length(llm):
    [out] = llm.generate(list(range(1, 120)), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
    assert out.outputs[0].finish_reason == "length" and 119 + len(out.outputs[0].token_ids) == 128


def test_chat(llm):
    [out] = llm.chat([{"role": "user", "content": "hi"}], GREEDY)
    ids = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                  add_generation_prompt=True)
    assert out.prompt_token_ids == llm.get_tokenizer().encode(ids, add_special_tokens=False)
    # the given params, not the model's defaults: GREEDY's 24 tokens, the same as generate's
    [again] = llm.generate([out.prompt_token_ids], GREEDY)
    assert out.outputs[0].token_ids == again.outputs[0].token_ids and len(again.outputs[0].token_ids) == 24


def test_chat_takes_a_list_of_conversations_and_answers_each_in_order(llm):
    convs = [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "a longer question, this one"}]]
    outs = llm.chat(convs, GREEDY)
    singles = [llm.chat(conv, GREEDY)[0] for conv in convs]
    assert [o.prompt_token_ids for o in outs] == [o.prompt_token_ids for o in singles]
    assert outs[0].prompt_token_ids != outs[1].prompt_token_ids
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in singles]


def test_unknown_flag_in_llm_kwargs(tiny):
    with pytest.raises(ConfigError, match="did you mean --block_size"):
        LLM(str(tiny), blok_size=8)


def test_detokenizer_multibyte(llm):
    tok = llm.engine.tokenizer
    text = "héllo wörld — 世界 🎉🎉 ok"
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [1, 2])
    pieces = [detok.add(t) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("breakage,needle", [
    ("missing", "does not exist"),
    ("no_config", "has no config.json"),
    ("bad_arch", "does not support"),
    ("corrupt", "corrupt or truncated"),
    ("truncated", "corrupt or truncated"),
    ("missing_tensor", "missing weights"),
])
def test_model_errors_name_the_path(tiny, tmp_path, breakage, needle):
    folder = tmp_path / "m"
    shutil.copytree(tiny, folder)
    weights = folder / "model.safetensors"
    if breakage == "missing":
        folder = tmp_path / "nope"
    elif breakage == "no_config":
        (folder / "config.json").unlink()
    elif breakage == "bad_arch":
        cfg = json.loads((folder / "config.json").read_text())
        cfg["architectures"] = ["GPTNeoXForCausalLM"]
        (folder / "config.json").write_text(json.dumps(cfg))
    elif breakage == "corrupt":
        weights.write_bytes(b"\x00" * 64)
    elif breakage == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    elif breakage == "missing_tensor":
        from safetensors.torch import load_file, save_file
        state = load_file(str(weights))
        state.pop("model.layers.1.mlp.up_proj.weight")
        save_file(state, str(weights))
    with pytest.raises(ConfigError) as info:
        LLM(str(folder), dtype="float32", num_gpu_blocks_override=16)
    assert needle in str(info.value) and str(folder.name) in str(info.value)


def test_prompt_logprobs_survive_a_preemption_mid_prefill(tiny):
    """A chunked prefill preempted after some chunks recomputes from the start: its prompt logprobs
    are neither cut short nor repeated."""
    prompt = list(range(5, 85))
    p = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, ignore_eos=True)
    roomy = LLM(str(tiny), dtype="float32", block_size=4, num_gpu_blocks_override=200, max_model_len=128)
    [want] = roomy.generate([prompt], p)
    roomy.shutdown()
    tight = LLM(str(tiny), dtype="float32", block_size=4, num_gpu_blocks_override=26, max_model_len=128,
                max_tokens_per_chunk_for_prefill=16, priority_strategy="priority", **ADMIT_ALL)
    engine = tight.engine
    rid = engine.add_request(prompt, p, priority=5)
    engine.step(), engine.step()  # two chunks in: 8 of 26 blocks
    hog = engine.add_request(list(range(7, 90)), SamplingParams(max_tokens=4, ignore_eos=True), priority=0)
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    got = outs[rid]
    assert got.metrics.num_preemptions >= 1 and hog in outs
    assert len(got.prompt_logprobs) == len(prompt) == len(want.prompt_logprobs)
    assert [lp and lp.token_id for lp in got.prompt_logprobs] == [lp and lp.token_id for lp in want.prompt_logprobs]
    assert [lp.logprob for lp in got.prompt_logprobs[1:]] == pytest.approx(
        [lp.logprob for lp in want.prompt_logprobs[1:]], abs=1e-4)
    tight.shutdown()


def test_chat_template_arguments_reach_the_template(llm):
    """`chat_template`, `add_generation_prompt` and extra template variables (vLLM's LLM.chat): a
    template written here renders the prompt these ids must be."""
    conv = [{"role": "user", "content": "hi"}]
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
                "{% if add_generation_prompt %}<bot>{% endif %}{{ suffix | default('') }}")
    tok = llm.get_tokenizer()
    for kwargs, text in [({}, "<user>hi<bot>"), ({"add_generation_prompt": False}, "<user>hi"),
                         ({"suffix": "!"}, "<user>hi<bot>!")]:
        [out] = llm.chat(conv, SamplingParams(max_tokens=1, temperature=0), chat_template=template, **kwargs)
        assert out.prompt_token_ids == tok.encode(text, add_special_tokens=False), kwargs


def test_chat_with_an_image_on_a_text_only_model_is_refused_naming_the_images(llm):
    url = "data:image/png;base64,iVBORw0KGgo="  # refused before it is read: the model takes no images
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is this?"}]}]
    with pytest.raises(RequestRejected, match="text-only") as refused:
        llm.chat(conv, GREEDY)
    assert refused.value.field == "messages.image"


def test_offline_priorities_order_the_prompts(tiny):
    """One sequence a step under priority scheduling: the prompts run lowest priority value first
    (1, then 2, then 0 for priorities [2, 0, 1]), and the outputs stay in input order."""
    llm = LLM(str(tiny), dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=128,
              priority_strategy="priority", max_seqs_per_batch=1)
    try:
        prompts = [[5, 6, 7], [8, 9, 10], [11, 12, 13]]
        outs = llm.generate(prompts, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True), priority=[2, 0, 1])
    finally:
        llm.shutdown()
    assert [o.prompt_token_ids for o in outs] == prompts
    finished = [o.metrics.finished_time for o in outs]
    assert sorted(range(3), key=finished.__getitem__) == [1, 2, 0]
