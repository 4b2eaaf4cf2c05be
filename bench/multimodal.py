"""Vision-language serving on CPU: a random-weight Qwen2-VL-shaped model (a 6-block vision tower of
width 384; a SmolLM2-sized decoder: hidden 576, 12 layers, 9 heads / 3 KV heads; SmolLM2's
tokenizer plus the vision tokens), heterollm against transformers on the same weights, same run.

    python bench/multimodal.py                        # the table in bench/RESULTS.md
    python bench/multimodal.py --concurrency 1 --output-len 4    # a smoke test

C requests arrive together, each one 224 x 224 image (64 placeholder tokens) and a short question,
--output-len greedy tokens each (ignore_eos); bf16. Images per second: C / the wall time until the
last request ends. TTFT: mean time from arrival to the first token (heterollm's request metrics;
transformers: one generate call of max_new_tokens=1 over the same batch, its processor included).
transformers runs the C prompts as one left-padded batch through its own processor.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

import common

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

TEXT = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=12, num_attention_heads=9,
            num_key_value_heads=3, max_position_embeddings=4096, rms_norm_eps=1e-5,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0, "mrope_section": [8, 12, 12]})
VISION = dict(depth=6, embed_dim=384, hidden_size=576, num_heads=6, mlp_ratio=4)


def build(folder: Path) -> Path:
    import transformers

    import helpers

    tok = transformers.AutoTokenizer.from_pretrained(str(helpers.smollm2_gguf().parent),
                                                     gguf_file=helpers.smollm2_gguf().name)
    tok.add_special_tokens({"additional_special_tokens": helpers.VLM_TOKENS})
    ids = tok.convert_tokens_to_ids(helpers.VLM_TOKENS)
    cfg = transformers.Qwen2VLConfig(
        text_config={**TEXT, "vocab_size": len(tok), "eos_token_id": tok.eos_token_id}, vision_config=VISION,
        vision_start_token_id=ids[0], vision_end_token_id=ids[1], image_token_id=ids[2], video_token_id=ids[3],
        tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.02)
    model.save_pretrained(folder, safe_serialization=True)
    tok.chat_template = helpers.VLM_CHAT_TEMPLATE
    tok.save_pretrained(folder)
    transformers.Qwen2VLImageProcessor(min_pixels=4 * 28 * 28, max_pixels=256 * 28 * 28).save_pretrained(folder)
    return folder


def requests(count: int, base: int = 0) -> list[tuple[str, object]]:
    """`count` prompts with images of their own (seeds base ..): no run hits another's prefix cache."""
    import helpers

    prompt = ("<|im_start|>user\n" + helpers.IMAGE_PLACEHOLDER + "What is in this picture?<|im_end|>\n"
              "<|im_start|>assistant\n")
    return [(prompt, helpers.random_image(224, 224, seed=base + i)) for i in range(count)]


def run_heterollm(folder: Path, batches: list[int], output_len: int) -> dict[int, tuple[float, float]]:
    from heterollm import LLM, SamplingParams

    llm = LLM(str(folder), dtype="bfloat16", max_model_len=1024, max_cache_size=1 << 30)
    sp = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    out = {}
    try:
        llm.generate([{"prompt": p, "multi_modal_data": {"image": img}} for p, img in requests(2, 99)], sp)  # warm-up
        for c in batches:
            reqs = [{"prompt": p, "multi_modal_data": {"image": img}} for p, img in requests(c, 1000 * c)]
            start = time.monotonic()  # the clock of the request metrics
            outs = llm.generate(reqs, sp)
            wall = time.monotonic() - start
            # from the call, so that loading and preprocessing the images count, as they do for transformers
            out[c] = (c / wall, statistics.mean(o.metrics.first_token_time - start for o in outs))
    finally:
        llm.shutdown()
    return out


def run_transformers(folder: Path, batches: list[int], output_len: int) -> dict[int, tuple[float, float]]:
    import transformers

    import helpers

    processor = helpers.hf_vlm_processor(folder)
    processor.tokenizer.padding_side = "left"
    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(str(folder), dtype=torch.bfloat16).eval()

    def generate(reqs: list, n: int) -> float:
        start = time.perf_counter()
        inputs = processor(text=[p for p, _ in reqs], images=[img for _, img in reqs], return_tensors="pt",
                           padding=True)
        with torch.no_grad():
            model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        return time.perf_counter() - start

    generate(requests(2, 99), 2)  # warm-up
    out = {}
    for c in batches:
        ttft = generate(requests(c, 1000 * c), 1)
        out[c] = (c / generate(requests(c, 1000 * c), output_len), ttft)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--skip-transformers", action="store_true")
    args = ap.parse_args()
    print(common.machine_line())
    print(f"command: {common.command_line()}")
    with tempfile.TemporaryDirectory() as tmp:
        folder = build(Path(tmp))
        ours = run_heterollm(folder, args.concurrency, args.output_len)
        theirs = {} if args.skip_transformers else run_transformers(folder, args.concurrency, args.output_len)
    print("\n| concurrent requests | heterollm images/s | transformers images/s | ratio | heterollm mean TTFT ms "
          "| transformers TTFT ms |")
    print("|---|---|---|---|---|---|")
    for c in args.concurrency:
        ips, ttft = ours[c]
        hips, httft = theirs.get(c, (float("nan"), float("nan")))
        print(f"| {c} | {ips:.2f} | {hips:.2f} | {ips / hips:.2f}x | {ttft * 1000:.0f} | {httft * 1000:.0f} |")


if __name__ == "__main__":
    main()
