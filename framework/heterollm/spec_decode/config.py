"""Which speculative decoding a launch runs: xLLM's flags or FastDeploy's `speculative_config`, checked
and folded into one SpecConfig.

xLLM's way: `--num_speculative_tokens K` (> 0 turns it on) with `--speculative_algorithm` (Suffix,
ngram, draft_model; MTP and Eagle3 need heads no family here loads; the DFlash drafters are not
built), `--draft_model`, the `--speculative_suffix_*` knobs and `--enable_probabilistic_draft`.
FastDeploy's way: `--speculative_config '{"method": "suffix", "num_speculative_tokens": 4, ...}'`
with vLLM's key names. One of the two, not both."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from heterollm.config.schema import HeterollmConfig
from heterollm.config.support import show_value

METHODS = {"suffix": "Suffix", "ngram": "ngram", "draft_model": "draft_model", "draft": "draft_model",
           "mtp": "MTP", "eagle3": "Eagle3", "eagle": "Eagle3", "dflash": "DFlash", "dflash2": "DFlash2",
           "dspark": "DSpark"}
"""speculative_config's `method` (any case) -> the xLLM algorithm name."""

REFUSED = {
    "MTP": "needs multi-token-prediction heads in the checkpoint (DeepSeek-V3 / Qwen3-Next style MTP layers); "
           "no model family heterollm serves loads them yet",
    "Eagle3": "needs an EAGLE-3 draft head (a checkpoint with the target's hidden-state inputs); no family "
              "heterollm serves loads one yet",
    "DFlash": "the block-diffusion drafter is not built (its draft checkpoints and kernels are NPU/GPU work)",
    "DFlash2": "the block-diffusion drafter is not built, and xLLM runs it on NPU only",
    "DSpark": "the DSpark drafter is not built",
}
ALTERNATIVES = "use Suffix, ngram or draft_model"

JSON_KEYS = {"method", "num_speculative_tokens", "model", "prompt_lookup_max", "prompt_lookup_min",
             "suffix_decoding_max_tree_depth", "suffix_decoding_max_cached_requests",
             "suffix_decoding_max_spec_factor", "suffix_decoding_min_token_prob", "enable_probabilistic_draft"}


@dataclass(frozen=True)
class SpecConfig:
    """A launch's speculative decoding (None when it is off)."""

    method: str
    """"Suffix", "ngram" or "draft_model"."""
    num_speculative_tokens: int
    draft_model: str = ""
    probabilistic: bool = False
    """draft_model only: drafts are sampled from the draft's distribution q (kept for rejection)
    instead of taken greedily."""
    suffix_max_depth: int = 64
    suffix_max_cached_requests: int = -1
    suffix_max_spec_factor: float = 1.0
    suffix_min_token_prob: float = 0.1
    ngram_max: int = 4
    ngram_min: int = 2
    tree: bool = False
    """Suffix only (--speculative_suffix_use_tree_spec): drafts form a tree, verified in one forward
    under an ancestor mask (an attention backend that supports_tree_attention)."""
    source: str = "--num_speculative_tokens"
    """Where it was asked for, for messages: the xLLM flags or --speculative_config."""

    @property
    def lookahead(self) -> int:
        """KV slots past a step's tokens the worker writes while proposing (a draft model's own
        forwards over its drafts); proposers that run on the engine write none."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0


def spec_problems(config: HeterollmConfig) -> list[str]:
    """One line per speculative decoding flag that cannot launch as given."""
    try:
        spec = resolve_spec(config)
    except ValueError as exc:
        return [str(exc)]
    problems = []
    if spec is not None and config.scheduler.enable_schedule_overlap:
        problems.append(f"--enable_schedule_overlap: cannot run with speculative decoding ({spec.source}): the next "
                        f"step's drafts follow from this step's verification, so it cannot be scheduled before "
                        f"this one ends")
    return problems


def resolve_spec(config: HeterollmConfig) -> SpecConfig | None:
    """The launch's SpecConfig, or None; ValueError naming the flag when the flags do not fit."""
    sp = config.speculative
    given = config.fastdeploy.speculative_config
    xllm_set = [n for n, f in type(sp).model_fields.items() if getattr(sp, n) != f.default]
    if given is not None:
        if xllm_set:
            raise ValueError(f"--speculative_config and --{xllm_set[0]} both configure speculative decoding; "
                             f"give one of them")
        return _from_json(given)
    if sp.num_speculative_tokens == 0:
        if xllm_set:
            name = xllm_set[0]
            raise ValueError(f"--{name}={show_value(getattr(sp, name))}: has no effect without "
                             f"--num_speculative_tokens > 0 (speculative decoding is off)")
        return None
    algo = sp.speculative_algorithm
    if algo in REFUSED:
        raise ValueError(f"--speculative_algorithm={algo}: {REFUSED[algo]}; {ALTERNATIVES}")
    suffix_flags = ("speculative_suffix_cache_max_depth", "speculative_suffix_max_cached_requests")
    if algo != "Suffix":
        for name in (*suffix_flags, "speculative_suffix_use_tree_spec"):
            if name in xllm_set:
                raise ValueError(f"--{name}: tunes Suffix decoding, but --speculative_algorithm={algo}")
    if algo == "draft_model" and not sp.draft_model:
        raise ValueError("--speculative_algorithm=draft_model: needs --draft_model PATH (a small model with the "
                         "target's tokenizer)")
    if algo != "draft_model" and sp.draft_model:
        raise ValueError(f"--draft_model: only --speculative_algorithm=draft_model uses a draft model ({algo} "
                         f"proposes from the tokens seen)")
    if sp.enable_probabilistic_draft and algo != "draft_model":
        raise ValueError(f"--enable_probabilistic_draft: {algo} proposes deterministically; only a draft model "
                         f"can sample its drafts")
    return SpecConfig(algo, sp.num_speculative_tokens, sp.draft_model, sp.enable_probabilistic_draft,
                      sp.speculative_suffix_cache_max_depth, sp.speculative_suffix_max_cached_requests,
                      tree=sp.speculative_suffix_use_tree_spec)


def _from_json(given: dict[str, Any]) -> SpecConfig:
    where = "--speculative_config"
    unknown = sorted(set(given) - JSON_KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown key {unknown[0]!r} (it takes {', '.join(sorted(JSON_KEYS))})")
    raw = given.get("method")
    if not isinstance(raw, str) or raw.lower() not in METHODS:
        raise ValueError(f"{where}: method must be one of {', '.join(sorted(set(METHODS)))}, got {raw!r}")
    method = METHODS[raw.lower()]
    if method in REFUSED:
        raise ValueError(f"{where}: method {raw!r}: {REFUSED[method]}; {ALTERNATIVES}")
    k = given.get("num_speculative_tokens")
    if not _int(k) or k <= 0:
        raise ValueError(f"{where}: num_speculative_tokens must be an integer > 0, got {k!r}")
    model = given.get("model") or ""
    if method == "draft_model" and not isinstance(model, str) or method == "draft_model" and not model:
        raise ValueError(f"{where}: method {raw!r} needs \"model\": the draft model's path")
    if method != "draft_model" and model:
        raise ValueError(f"{where}: \"model\" is only used by method draft_model, not {raw!r}")
    prob = given.get("enable_probabilistic_draft", False)
    if not isinstance(prob, bool) or prob and method != "draft_model":
        raise ValueError(f"{where}: enable_probabilistic_draft must be a boolean, and only method draft_model "
                         f"samples its drafts")
    owned = {"Suffix": "suffix_decoding_", "ngram": "prompt_lookup_"}
    for key in given:
        for m, prefix in owned.items():
            if key.startswith(prefix) and method != m:
                raise ValueError(f"{where}: {key} tunes method {m}, not {raw!r}")
    lo, hi = given.get("prompt_lookup_min"), given.get("prompt_lookup_max")
    hi = hi if hi is not None else (lo if lo is not None else 4)
    lo = lo if lo is not None else min(2, hi)
    depth = given.get("suffix_decoding_max_tree_depth", 64)
    cached = given.get("suffix_decoding_max_cached_requests", -1)
    factor = given.get("suffix_decoding_max_spec_factor", 1.0)
    prob_min = given.get("suffix_decoding_min_token_prob", 0.1)
    checks = [("prompt_lookup_min", lo, _int(lo) and lo >= 1, "an integer >= 1"),
              ("prompt_lookup_max", hi, _int(hi) and _int(lo) and hi >= lo, "an integer >= prompt_lookup_min"),
              ("suffix_decoding_max_tree_depth", depth, _int(depth) and depth >= 1, "an integer >= 1"),
              ("suffix_decoding_max_cached_requests", cached, _int(cached) and cached >= -1,
               "-1 (no limit), 0 (no global cache) or a positive integer"),
              ("suffix_decoding_max_spec_factor", factor, _num(factor) and factor > 0, "a number > 0"),
              ("suffix_decoding_min_token_prob", prob_min, _num(prob_min) and 0 <= prob_min <= 1, "in [0, 1]")]
    for key, value, ok, need in checks:
        if not ok:
            raise ValueError(f"{where}: {key} must be {need}, got {value!r}")
    return SpecConfig(method, k, model, prob, depth, cached, float(factor), float(prob_min), hi, lo, source=where)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)
