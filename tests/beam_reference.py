"""A beam search written from the spec on transformers' own forward: the independent reference the
beam search tests compare LLM.beam_search and the HTTP `use_beam_search` against."""
from __future__ import annotations

import torch


def hf_beam_search(model, prompt: list[int], width: int, max_tokens: int, eos: int | None = None,
                   length_penalty: float = 1.0) -> list[tuple[list[int], float, str]]:
    """The spec, spelled out: each round every live beam offers its 2*width most likely next tokens;
    an EOS offer finishes that beam (EOS dropped), the best `width` other offers live on; the finished
    and the survivors are ranked by cum_logprob / len(prompt + generated) ** length_penalty."""
    live = [(list(prompt), 0.0)]
    finished = []
    for _ in range(max_tokens):
        offers = []
        for tokens, cum in live:
            with torch.no_grad():
                logprobs = model(torch.tensor([tokens])).logits[0, -1].double().log_softmax(-1)
            top = logprobs.topk(2 * width)
            for token, lp in zip(top.indices.tolist(), top.values.tolist()):
                if token == eos:
                    finished.append((tokens, cum + lp, "stop"))
                else:
                    offers.append((tokens + [token], cum + lp))
        offers.sort(key=lambda o: o[1], reverse=True)
        live = offers[:width]
    finished += [(tokens, cum, "length") for tokens, cum in live]
    finished.sort(key=lambda f: f[1] / len(f[0]) ** length_penalty, reverse=True)
    return finished[:width]
