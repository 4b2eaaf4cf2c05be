"""`heterollm generate`: run one prompt offline and stream the answer to the terminal."""
from __future__ import annotations

import json
import sys
from typing import Optional

from heterollm.config import ConfigError, LoadedConfig
from heterollm.config.base import FlagGroup, flag
from heterollm.config.checks import check_single_replica


class GenerateFlags(FlagGroup):
    """Flags of `heterollm generate` (besides every launch flag)."""

    prompt: str = flag("", "The prompt text (required).")
    chat: bool = flag(False, "Wrap the prompt as a user message and apply the model's chat template.")
    system: Optional[str] = flag(None, "System message for --chat (the template's default when unset).")
    max_tokens: int = flag(256, "Maximum number of tokens to generate.", gt=0)
    temperature: Optional[float] = flag(None, "Sampling temperature; 0 = greedy. Default: the model's "
                                              "generation_config, else 1.0.", ge=0)
    top_p: Optional[float] = flag(None, "Nucleus sampling mass in (0, 1].", gt=0, le=1)
    top_k: Optional[int] = flag(None, "Keep the k most likely tokens; 0 or -1 = off.", ge=-1)
    min_p: float = flag(0.0, "Drop tokens below min_p * p(most likely).", ge=0, le=1)
    repetition_penalty: Optional[float] = flag(None, "Penalty > 1 discourages tokens already seen.", gt=0)
    presence_penalty: float = flag(0.0, "Penalty for tokens already generated, once each.", ge=-2, le=2)
    frequency_penalty: float = flag(0.0, "Penalty per occurrence of a generated token.", ge=-2, le=2)
    seed: Optional[int] = flag(None, "Per-request sampling seed (reproducible output).")
    stop: str = flag("", "Stop string, or a JSON list of stop strings; never included in the output.")
    ignore_eos: bool = flag(False, "Keep generating past the end-of-sequence token.")
    n: int = flag(1, "Number of completions.", gt=0)
    stream: bool = flag(True, "Print tokens as they arrive (--nostream prints the answer at the end).")


def _sampling(extra: dict, defaults: dict):
    from heterollm.sampling import SamplingParams, SamplingParamsError

    stop = extra["stop"]
    if stop.startswith("["):
        try:
            stop = json.loads(stop)
        except json.JSONDecodeError:
            raise ConfigError("--stop: not a valid JSON list of strings") from None
    kwargs = {**defaults, **{k: extra[k] for k in ("temperature", "top_p", "top_k", "repetition_penalty")
                             if extra[k] is not None}}
    try:
        return SamplingParams(n=extra["n"], max_tokens=extra["max_tokens"], min_p=extra["min_p"],
                              presence_penalty=extra["presence_penalty"],
                              frequency_penalty=extra["frequency_penalty"], seed=extra["seed"],
                              stop=[stop] if isinstance(stop, str) and stop else stop or [],
                              ignore_eos=extra["ignore_eos"], **kwargs)
    except SamplingParamsError as exc:
        raise ConfigError(f"--{exc}") from None


def run_generate(loaded: LoadedConfig) -> int:
    from heterollm.engine.llm_engine import LLMEngine
    from heterollm.scheduler.request import RequestRejected

    extra = loaded.extra
    if not extra["prompt"]:
        raise ConfigError("--prompt is required for `heterollm generate`")
    check_single_replica(loaded.config, "`heterollm generate`")
    engine = LLMEngine(loaded.config)
    params = _sampling(extra, engine.source.generation_defaults)
    try:
        if extra["chat"]:
            messages = ([{"role": "system", "content": extra["system"]}] if extra["system"] else []) + \
                       [{"role": "user", "content": extra["prompt"]}]
            try:
                ids = engine.tokenizer.apply_chat_template(messages)
            except ValueError as exc:
                raise ConfigError(f"--chat: {exc}") from None
            request_id = engine.add_request(extra["prompt"], params, prompt_token_ids=ids)
        else:
            request_id = engine.add_request(extra["prompt"], params)
    except RequestRejected as exc:
        raise ConfigError(f"--{exc.field}: {exc}") from None
    stream = extra["stream"] and params.n == 1
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id != request_id:
                continue
            if stream and out.outputs[0].delta_text:
                sys.stdout.write(out.outputs[0].delta_text)
                sys.stdout.flush()
            if out.finished:
                final = out
    if final is None:
        print("heterollm: error: the request ended without output", file=sys.stderr)
        return 1
    if stream:
        sys.stdout.write("\n")
    else:
        for c in final.outputs:
            prefix = f"[{c.index}] " if params.n > 1 else ""
            print(prefix + c.text)
    m = final.metrics
    ttft = f"{m.ttft * 1000:.0f} ms" if m.ttft is not None else "-"
    tpot = f"{m.tpot * 1000:.1f} ms" if m.tpot is not None else "-"
    reasons = ", ".join(str(c.finish_reason) for c in final.outputs)
    print(f"[{m.num_prompt_tokens} prompt tokens, {m.num_generated_tokens} generated, finish: {reasons}, "
          f"TTFT {ttft}, TPOT {tpot}]", file=sys.stderr)
    engine.shutdown()
    return 0
