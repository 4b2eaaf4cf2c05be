"""Structured output's cost: output tok/s under a JSON schema vs unconstrained, same prompts, same
run, at batch 1, 16 and 64; and grammar compile time, first and cached.

    python bench/structured.py                          # SmolLM2-135M, batches 1,16,64
    python bench/structured.py --batches 1,4 --items 8  # a smoke test

The schema is an array of exactly --items one-digit integers without optional whitespace
(`disable_any_whitespace`: `[0, 1, ...]`): every constrained answer is the same length (3 x items +
1 tokens with SmolLM2's tokenizer: each digit, comma and space, the brackets, EOS), and the
unconstrained row generates exactly that many tokens per request (EOS ignored), so both rows do the
same steps on the same batch. The
constrained answers are checked to be valid against the schema. Compile time: the 20 schemas of
tests/json_schemas.py, each compiled once (first) and again (a cache hit), on the engine's compiler
thread, as a request sees it.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import common


def schema(items: int) -> dict:
    return {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": items, "maxItems": items}


def run_row(llm, prompts, params) -> tuple[float, int, list]:
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    return wall, sum(len(c.token_ids) for o in outs for c in o.outputs), outs


def compile_times(llm) -> tuple[list[float], list[float]]:
    sys.path.insert(0, str(common.ROOT / "tests"))
    from json_schemas import SCHEMAS  # noqa: PLC0415
    from heterollm.sampling import StructuredOutputsParams  # noqa: PLC0415

    first, cached = [], []
    for s in SCHEMAS:
        for into in (first, cached):
            t0 = time.perf_counter()
            llm.engine.compile_grammar(StructuredOutputsParams(json=s)).result()
            into.append(time.perf_counter() - t0)
    return first, cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--items", type=int, default=48)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    import jsonschema  # noqa: PLC0415

    from heterollm import LLM, SamplingParams  # noqa: PLC0415

    llm = LLM(args.model, dtype=args.dtype, guided_decoding_backend="auto", block_size=16)
    tok = llm.engine.tokenizer
    question = "List some digits as a JSON array."
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    spec = {"json": schema(args.items), "disable_any_whitespace": True}
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=4, temperature=0,
                                                                structured_outputs=spec))  # warm-up + compile
    first, cached = compile_times(llm)
    print(common.machine_line())
    print(f"command: {common.command_line()}")
    print(f"model {args.model}, prompt {len(prompt)} tokens, schema: array of {args.items} digits, no optional whitespace\n")
    print("| batch | unconstrained tok/s | JSON schema tok/s | schema / unconstrained | tokens each |")
    print("|---|---|---|---|---|")
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [{"prompt_token_ids": prompt}] * batch
        # seeds differ per request so the batch is not one answer repeated
        constrained = [SamplingParams(max_tokens=4 * args.items, temperature=0.8, seed=i, structured_outputs=spec)
                       for i in range(batch)]
        wall_c, n_c, outs = run_row(llm, prompts, constrained)
        for o in outs:
            jsonschema.validate(json.loads(o.outputs[0].text), schema(args.items))
        per_request = n_c // batch
        free = [SamplingParams(max_tokens=per_request, temperature=0.8, seed=i, ignore_eos=True) for i in range(batch)]
        wall_f, n_f, _ = run_row(llm, prompts, free)
        row = {"batch": batch, "free_tok_s": n_f / wall_f, "schema_tok_s": n_c / wall_c, "tokens_each": per_request}
        rows.append(row)
        print(f"| {batch} | {row['free_tok_s']:.1f} | {row['schema_tok_s']:.1f} | "
              f"{row['schema_tok_s'] / row['free_tok_s']:.2f} | {per_request} |", flush=True)
    print(f"\ngrammar compile, 20 schemas of tests/json_schemas.py: first median {statistics.median(first) * 1e3:.1f} ms "
          f"(max {max(first) * 1e3:.1f}), cached median {statistics.median(cached) * 1e3:.3f} ms")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": common.machine_info(), "rows": rows, "compile_first_s": first,
                       "compile_cached_s": cached}, fh, indent=1)
    llm.shutdown()


if __name__ == "__main__":
    main()
