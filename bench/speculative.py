"""Speculative decoding on the default model (SmolLM2-135M-Instruct): decode speed with speculation
against without it, same run, same machine, greedy (so every configuration generates the same
tokens and the rows compare time only).

    python bench/speculative.py                       # suffix (path and tree) and n-gram vs off, batch 1 and 8
    python bench/speculative.py --methods suffix --batches 1 --prompts 2 --max-tokens 32   # smoke test

Workloads (chat-templated, answered until EOS or --max-tokens):
  (a) copy-heavy: repeat or lightly edit a given passage, or answer about a given code snippet
      (the answer reuses spans of the prompt: what prompt lookup and suffix trees find);
  (b) open-ended: questions whose answers copy nothing from the prompt.
Batch 1 runs the prompts one after the other; batch 8 runs them together. tok/s = generated tokens /
wall seconds of the `generate` call. Every configuration is a fresh `LLM` in this process (its
load time excluded); a warm-up request runs first. The suffix proposer's global cache starts empty
for each configuration and learns from the workload's earlier requests, as in a server.
"""
from __future__ import annotations

import argparse
import time

import common

PASSAGE = ("The library opens at nine in the morning and closes at six in the evening. Visitors must show a "
           "card at the entrance. Books can be borrowed for two weeks, and each card holder may borrow up to "
           "five books at a time. Late returns cost ten cents per day.")
CODE = '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result'''
COPY = [
    f"Repeat the following passage exactly, word for word:\n\n{PASSAGE}",
    f"Rewrite this passage, replacing 'library' with 'museum' and changing nothing else:\n\n{PASSAGE}",
    f"Here is a Python function:\n\n{CODE}\n\nRewrite it with the variable `total` renamed to `running_sum`.",
    f"Here is a Python function:\n\n{CODE}\n\nCopy the function and add a docstring to it.",
    f"Repeat this text twice:\n\n{PASSAGE}",
    f"Here is some code:\n\n{CODE}\n\nWhat does this function return? Quote the line that computes it.",
    f"Copy this paragraph and put each sentence on its own line:\n\n{PASSAGE}",
    f"Here is a function:\n\n{CODE}\n\nRewrite it so that `window` is called `size`.",
]
OPEN = [
    "Write a short poem about the sea at night.",
    "Give three tips for learning to play the guitar.",
    "Why is the sky blue? Explain simply.",
    "Describe a day in the life of a lighthouse keeper.",
    "What are the benefits of regular exercise?",
    "Invent a name and a slogan for a new coffee shop.",
    "Explain what a black hole is to a ten-year-old.",
    "List some fun things to do on a rainy weekend.",
]
METHODS = {
    "off": {},
    "suffix": dict(speculative_algorithm="Suffix", num_speculative_tokens=8),
    "ngram": dict(speculative_algorithm="ngram", num_speculative_tokens=4),
    "suffix-tree": dict(speculative_algorithm="Suffix", num_speculative_tokens=8, speculative_suffix_use_tree_spec=True),
}


def run(llm, prompts, batch: int, max_tokens: int):
    from heterollm import SamplingParams  # noqa: PLC0415

    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    engine = llm.engine
    before = (engine.spec_stats.num_drafts, engine.spec_stats.num_draft_tokens, engine.spec_stats.num_accepted_tokens)
    outs, wall = [], 0.0
    for start in range(0, len(prompts), batch):
        chunk = [{"prompt_token_ids": p} for p in prompts[start:start + batch]]
        t = time.perf_counter()
        outs += llm.generate(chunk, params)
        wall += time.perf_counter() - t
    s = engine.spec_stats
    checks, drafts, accepted = (s.num_drafts - before[0], s.num_draft_tokens - before[1],
                                s.num_accepted_tokens - before[2])
    tokens = [o.outputs[0].token_ids for o in outs]
    return {"tokens": sum(map(len, tokens)), "tok_s": sum(map(len, tokens)) / wall, "wall": wall,
            "acceptance": accepted / drafts if drafts else None,
            "accepted_len": 1 + accepted / checks if checks else None, "outputs": tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--methods", default="suffix,suffix-tree,ngram")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per workload (at most 8)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from heterollm import LLM, SamplingParams  # noqa: PLC0415
    from heterollm.spec_decode import make_proposer  # noqa: PLC0415

    methods = ["off", *[m for m in args.methods.split(",") if m != "off"]]
    batches = [int(b) for b in args.batches.split(",")]
    rows = []
    results: dict[tuple[str, str, int], dict] = {}
    for method in methods:
        llm = LLM(args.model, dtype=args.dtype, block_size=16, **METHODS[method])
        tok = llm.engine.tokenizer
        workloads = {name: [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
                            for q in qs[:args.prompts]] for name, qs in (("copy", COPY), ("open", OPEN))}
        llm.generate([{"prompt_token_ids": workloads["open"][0]}], SamplingParams(max_tokens=8, temperature=0))
        for name, prompts in workloads.items():
            for batch in batches:
                if llm.engine.proposer is not None:  # the suffix cache starts empty for every row
                    llm.engine.proposer = make_proposer(llm.engine.spec)
                results[(method, name, batch)] = run(llm, prompts, batch, args.max_tokens)
        llm.shutdown()
    for (method, name, batch), r in results.items():
        base = results[("off", name, batch)]
        same = r["outputs"] == base["outputs"]
        rows.append({"workload": "(a) copy-heavy" if name == "copy" else "(b) open-ended", "batch": batch,
                     "method": method, "tokens": r["tokens"], "tok_s": r["tok_s"],
                     "speedup": r["tok_s"] / base["tok_s"], "acceptance": r["acceptance"],
                     "accepted_len": r["accepted_len"], "same": "yes" if same else "NO"})
    rows.sort(key=lambda r: (r["workload"], r["batch"], r["method"] != "off", r["method"]))
    invariant = {name: all(results[("off", name, b)]["outputs"] == results[("off", name, batches[0])]["outputs"]
                           for b in batches) for name in ("copy", "open")}
    common.print_table(
        f"Speculative decoding, {args.model}, greedy, max_tokens {args.max_tokens}, {args.prompts} prompts per workload",
        rows, [("workload", "workload", 0), ("batch", "batch", 0), ("method", "speculation", 0),
               ("tokens", "tokens", 0), ("tok_s", "tok/s", 1), ("speedup", "vs off", 2),
               ("acceptance", "accepted", 2), ("accepted_len", "tokens/verify", 2), ("same", "same tokens", 0)],
        notes=["vs off: tok/s over the same workload and batch without speculation (same run); accepted: accepted "
               "drafts / drafts; tokens/verify: tokens a verification step emits (accepted + 1); same tokens: "
               "greedy output identical to the run without speculation",
               "without speculation, batch " + " vs ".join(map(str, batches)) + " gave identical tokens: "
               + ", ".join(f"{n} {'yes' if ok else 'NO'}" for n, ok in invariant.items())
               + " (in bf16 a forward over more rows may round differently and flip a near-tie; fp32 does not)"])
    common.write_json(args.json, {"machine": common.machine_info(), "rows": rows})


if __name__ == "__main__":
    main()
