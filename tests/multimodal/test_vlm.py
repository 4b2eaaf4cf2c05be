"""Vision-language models (issue 25) against transformers on tiny random Qwen2-VL and Qwen2.5-VL
checkpoints: greedy tokens identical and logprobs within 1e-3, with one image, several images of
different sizes in one batch, a prompt chunked across its image, the encoder cache, the prefix cache
naming images by content, and bad input refused by field."""
from __future__ import annotations

import io

import pytest

from helpers import IMAGE_PLACEHOLDER, build_tiny_model, build_tiny_vlm, hf_vlm_greedy, random_image

TOL = 1e-3
FLAGS = dict(dtype="float32", block_size=8, num_gpu_blocks_override=256, max_model_len=512)


def chat_prompt(*parts: str) -> str:
    return f"<|im_start|>user\n{''.join(parts)}<|im_end|>\n<|im_start|>assistant\n"


def _runner(llm):
    return llm.engine.executor.runner


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def vlm(request, tmp_path_factory):
    return build_tiny_vlm(tmp_path_factory.mktemp(request.param), request.param)


def _check_against_hf(folder, prompts, outs, n):
    for (prompt, images), out in zip(prompts, outs):
        ids, want, logprobs = hf_vlm_greedy(folder, prompt, images, n)
        assert out.prompt_token_ids == ids  # the placeholders expanded as transformers' processor does
        got = out.outputs[0].token_ids
        assert got == want
        drift = max(abs(lp.logprob - logprobs[i, t].item()) for i, (t, lp) in enumerate(zip(got, out.outputs[0].logprobs)))
        assert drift < TOL


def test_batch_of_images_matches_transformers(vlm):
    """One batch: one image, two images of different sizes, a text-only prompt."""
    from heterollm import LLM, SamplingParams

    prompts = [(chat_prompt(IMAGE_PLACEHOLDER, "What is this?"), [random_image(90, 60)]),
               (chat_prompt("First ", IMAGE_PLACEHOLDER, " then ", IMAGE_PLACEHOLDER, " compare."),
                [random_image(140, 120, seed=1), random_image(56, 84, seed=2)]),
               (chat_prompt("No picture here."), [])]
    llm = LLM(str(vlm), **FLAGS)
    try:
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} if imgs else p for p, imgs in prompts],
                            SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1))
        assert _runner(llm).mm.images_encoded == 3
    finally:
        llm.shutdown()
    _check_against_hf(vlm, prompts, outs, 8)


@pytest.mark.slow
@pytest.mark.parametrize("cache_mb,encodes", [(0, 3), (64, 1)])
def test_prompt_chunked_across_the_image(tmp_path_factory, cache_mb, encodes):
    """Chunks of 8 tokens split a 20-token image over three steps: the same tokens as transformers;
    without an encoder cache each chunk encodes the image again, with one it is encoded once."""
    from heterollm import LLM, SamplingParams

    folder = build_tiny_vlm(tmp_path_factory.mktemp("chunked"), "qwen2_vl")
    prompt = chat_prompt(IMAGE_PLACEHOLDER, "Describe.")
    image = random_image(140, 120, seed=3)
    llm = LLM(str(folder), **FLAGS, max_tokens_per_chunk_for_prefill=8, max_encoder_cache_size=cache_mb)
    try:
        outs = llm.generate([{"prompt": prompt, "multi_modal_data": {"image": image}}],
                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1))
        assert _runner(llm).mm.images_encoded == encodes
    finally:
        llm.shutdown()
    _check_against_hf(folder, [(prompt, [image])], outs, 6)


def test_prefix_cache_names_images_by_content(tmp_path_factory):
    """The same image and text hit the prefix cache past the image; a different image (same text,
    same token ids) hits only the blocks before it, and still answers as transformers does."""
    from heterollm import LLM, SamplingParams

    folder = build_tiny_vlm(tmp_path_factory.mktemp("prefix"), "qwen2_vl")
    text = "A long shared system line that fills a few blocks. " * 2
    prompt = chat_prompt(text, IMAGE_PLACEHOLDER, "What now?")
    a, b = random_image(140, 120, seed=4), random_image(140, 120, seed=5)
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)
    llm = LLM(str(folder), **FLAGS, max_encoder_cache_size=0)
    try:
        first = llm.generate({"prompt": prompt, "multi_modal_data": {"image": a}}, sp)[0]
        image_at = first.prompt_token_ids.index(llm.engine.source.hf_config.image_token_id)
        total = len(first.prompt_token_ids)
        same = llm.generate({"prompt": prompt, "multi_modal_data": {"image": a}}, sp)[0]
        other = llm.generate({"prompt": prompt, "multi_modal_data": {"image": b}}, sp)[0]
    finally:
        llm.shutdown()
    assert same.metrics.num_cached_tokens == (total - 1) // 8 * 8  # every full block but the last token's
    assert other.metrics.num_cached_tokens == image_at // 8 * 8  # up to the block the image starts in
    assert same.outputs[0].token_ids == first.outputs[0].token_ids
    _check_against_hf(folder, [(prompt, [b])], [other], 4)


def test_chat_with_image_parts(vlm):
    """LLM.chat: an image part (a PNG data URL) renders as the placeholder and answers as the prompt."""
    import base64

    from heterollm import LLM, SamplingParams

    image = random_image(90, 60, seed=6)
    png = io.BytesIO()
    image.save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "What is this?"}]}]
    llm = LLM(str(vlm), **FLAGS)
    try:
        out = llm.chat(messages, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1))
    finally:
        llm.shutdown()
    _check_against_hf(vlm, [(chat_prompt(IMAGE_PLACEHOLDER, "What is this?"), [image])], out, 6)


@pytest.fixture(scope="module")
def small_vlm(tmp_path_factory):
    from heterollm import LLM

    llm = LLM(str(build_tiny_vlm(tmp_path_factory.mktemp("bad"), "qwen2_vl")), **FLAGS, limit_image_per_prompt=2)
    yield llm
    llm.shutdown()


@pytest.mark.parametrize("prompt,data,field,words", [
    (chat_prompt("no placeholder"), {"image": "IMG"}, "multi_modal_data.image", "1 image(s) were given"),
    (chat_prompt(IMAGE_PLACEHOLDER * 3), {"image": ["IMG"] * 3}, "multi_modal_data.image", "limit of 2"),
    (chat_prompt(IMAGE_PLACEHOLDER), {"image": b"not an image"}, "multi_modal_data.image.0", "not a decodable image"),
    (chat_prompt(IMAGE_PLACEHOLDER), {"image": "data:text/plain;base64,aGk="}, "multi_modal_data.image.0", "image"),
    (chat_prompt(IMAGE_PLACEHOLDER), {"video": ["x"]}, "multi_modal_data.video", "not supported"),
])
def test_bad_images_are_refused_by_field(small_vlm, prompt, data, field, words):
    """Each bad input is a RequestRejected naming its field; the engine serves the next request."""
    from heterollm import SamplingParams
    from heterollm.scheduler.request import RequestRejected

    data = {k: ([random_image(56, 56) if x == "IMG" else x for x in v] if isinstance(v, list)
                else (random_image(56, 56) if v == "IMG" else v)) for k, v in data.items()}
    with pytest.raises(RequestRejected) as err:
        small_vlm.generate({"prompt": prompt, "multi_modal_data": data}, SamplingParams(max_tokens=2))
    assert err.value.field == field
    assert words in str(err.value)
    ok = small_vlm.generate({"prompt": chat_prompt(IMAGE_PLACEHOLDER), "multi_modal_data": {"image": random_image(56, 56)}},
                            SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(ok[0].outputs[0].token_ids) == 2


def test_mm_processor_kwargs_bound_the_image(small_vlm):
    """max_pixels (per request) shrinks the image's grid, hence its placeholder count; an unknown key
    is refused naming mm_processor_kwargs."""
    from heterollm import SamplingParams
    from heterollm.scheduler.request import RequestRejected

    image = random_image(280, 280)
    sp = SamplingParams(max_tokens=1)
    full = small_vlm.generate({"prompt": IMAGE_PLACEHOLDER, "multi_modal_data": {"image": image}}, sp)[0]
    small = small_vlm.generate({"prompt": IMAGE_PLACEHOLDER, "multi_modal_data": {"image": image},
                                "mm_processor_kwargs": {"max_pixels": 16 * 28 * 28}}, sp)[0]
    # the folder's processor caps an image at 64 x 28 x 28 pixels: a square one -> 16 x 16 patches -> 8 x 8 tokens
    assert len(full.prompt_token_ids) - 2 == 64
    assert len(small.prompt_token_ids) - 2 == 16  # 16 x 28 x 28 pixels -> 8 x 8 patches -> 4 x 4 tokens
    with pytest.raises(RequestRejected) as err:
        small_vlm.generate({"prompt": IMAGE_PLACEHOLDER, "multi_modal_data": {"image": image},
                            "mm_processor_kwargs": {"fps": 2}}, sp)
    assert err.value.field == "mm_processor_kwargs"


def test_text_only_model_refuses_images_and_mm_flags(tmp_path_factory):
    from heterollm import LLM, SamplingParams
    from heterollm.config import ConfigError
    from heterollm.scheduler.request import RequestRejected

    folder = build_tiny_model(tmp_path_factory.mktemp("text"), "qwen2")
    for flags, words in [({"limit_image_per_prompt": 2}, "--limit_image_per_prompt: the model is text-only"),
                         ({"backend": "vlm"}, "--backend=vlm: the model is text-only"),
                         ({"enable_mm_encoder_dp": True}, "--enable_mm_encoder_dp: the model is text-only")]:
        with pytest.raises(ConfigError, match=words.replace("-", r"\-")):
            LLM(str(folder), **FLAGS, **flags)
    llm = LLM(str(folder), **FLAGS)
    try:
        with pytest.raises(RequestRejected) as err:
            llm.generate({"prompt": "hi", "multi_modal_data": {"image": random_image(56, 56)}}, SamplingParams(max_tokens=1))
        assert err.value.field == "multi_modal_data.image" and "text-only" in str(err.value)
    finally:
        llm.shutdown()


def test_vlm_launch_flags(vlm):
    from heterollm import LLM
    from heterollm.config import ConfigError
    from heterollm.plugins.resolver import LaunchError

    for flags, words in [({"enable_mm_encoder_dp": True}, "needs --tp_size > 1"),
                         ({"backend": "llm"}, "is a vision-language model"),
                         ({"limit_mm_per_prompt": '{"sound": 1}'}, "unknown modality 'sound'"),
                         ({"mm_processor_kwargs": '{"fps": 1}'}, "--mm_processor_kwargs: 'fps' is not supported"),
                         ({"task": "mm_embed"}, "multimodal embeddings"),
                         ({"use_audio_in_video": True}, "no family heterollm serves takes audio")]:
        with pytest.raises((ConfigError, LaunchError), match=words.replace("-", r"\-")):
            LLM(str(vlm), **FLAGS, **flags)


@pytest.mark.slow
@pytest.mark.parametrize("encoder_dp", [False, True])
def test_tensor_parallel_matches_transformers(tmp_path_factory, encoder_dp):
    """--tp_size 2: the decoder sharded, the vision tower on both ranks; with --enable_mm_encoder_dp
    the three images of the batch are split 2 / 1 between the ranks and all-gathered."""
    from heterollm import LLM, SamplingParams

    folder = build_tiny_vlm(tmp_path_factory.mktemp("tp"), "qwen2_5_vl")
    prompts = [(chat_prompt(IMAGE_PLACEHOLDER, "What is this?"), [random_image(90, 60)]),
               (chat_prompt("First ", IMAGE_PLACEHOLDER, " then ", IMAGE_PLACEHOLDER, " compare."),
                [random_image(140, 120, seed=1), random_image(56, 84, seed=2)])]
    llm = LLM(str(folder), **FLAGS, tp_size=2, enable_mm_encoder_dp=encoder_dp)
    try:
        outs = llm.generate([{"prompt": p, "multi_modal_data": {"image": imgs}} for p, imgs in prompts],
                            SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1))
    finally:
        llm.shutdown()
    _check_against_hf(folder, prompts, outs, 6)


def test_calls_without_image_support_refuse_images(small_vlm):
    """embed / beam search take no images: a prompt carrying them is refused, not run without them."""
    from heterollm.engine.beam_search import BeamSearchParams
    from heterollm.scheduler.request import RequestRejected

    prompt = {"prompt": chat_prompt(IMAGE_PLACEHOLDER), "multi_modal_data": {"image": random_image(56, 56)}}
    with pytest.raises(RequestRejected) as err:
        small_vlm.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=2))
    assert err.value.field == "multi_modal_data"
    assert str(err.value).endswith("images are taken by generate and chat only (not by embed, score or beam search)")
