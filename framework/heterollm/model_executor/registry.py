"""The model class a launch runs: chosen once by the resolver per (architecture, family) from the
backend descriptors' `models` (the core registers its own under the family "core", through its
descriptor `heterollm.model_executor.models:CORE_BACKEND`)."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from heterollm.config import ConfigError

if TYPE_CHECKING:
    from heterollm.plugins.resolver import Selection


def supported_architectures() -> list[str]:
    """Every architecture some installed family implements."""
    from heterollm.plugins import get_registry

    return get_registry().names("models")


def get_model_class(selection: Selection, architectures: Sequence[str], where: str) -> type:
    """The selected implementation of the checkpoint's architecture, or a ConfigError naming what
    is supported."""
    if selection.model is None or selection.model.name not in architectures:
        raise ConfigError(f"--model: {where} has architecture {list(architectures) or '(none)'}, which heterollm "
                          f"does not support (supported: {', '.join(supported_architectures())})")
    return selection.model.obj


def check_model_support(selection: Selection, hf_config: Any, kv_cache_dtype: str = "auto") -> None:
    """Raise a LaunchError when the selected attention backend cannot run this checkpoint faithfully:
    a sliding window or capped attention scores it does not honour would silently change answers,
    and latent attention (MLA) it does not implement could not run at all; nor can a quantized KV
    cache (--kv_cache_dtype) the backend does not store, or one of a latent cache."""
    from heterollm.model_executor.layers import sliding_window
    from heterollm.plugins.resolver import LaunchError

    num_layers = int(getattr(hf_config, "num_hidden_layers", 0) or 0)
    windows = sorted({w for i in range(num_layers) if (w := sliding_window(hf_config, i)) is not None})
    softcap = getattr(hf_config, "attn_logit_softcapping", None)
    attention = selection.components["attention"]
    backend = f"attention {attention.name} ({attention.dist} {attention.version})"
    reasons = []
    if windows and not attention.obj.supports_sliding_window():
        reasons.append(f"--model: the checkpoint attends over a sliding window of {windows[0]} tokens, which "
                       f"{backend} does not honour (supports_sliding_window() is False); choose an attention "
                       f"family that does, e.g. the CPU backend's")
    if softcap is not None and not attention.obj.supports_logit_softcap():
        reasons.append(f"--model: the checkpoint caps attention scores (attn_logit_softcapping={softcap}), which "
                       f"{backend} does not (supports_logit_softcap() is False); choose an attention family "
                       f"that does, e.g. the CPU backend's")
    if is_mla_config(hf_config) and not attention.obj.supports_mla():
        reasons.append(f"--model: the checkpoint uses multi-head latent attention (kv_lora_rank="
                       f"{hf_config.kv_lora_rank}), which {backend} does not implement (supports_mla() is "
                       f"False); choose an attention family that does, e.g. the CPU backend's")
    reasons += _kv_cache_dtype_problems(backend, attention.obj, hf_config, kv_cache_dtype)
    if reasons:
        raise LaunchError(reasons)


def _kv_cache_dtype_problems(backend: str, attention: Any, hf_config: Any, kv_cache_dtype: str) -> list[str]:
    if kv_cache_dtype == "auto":
        return []
    flag = f"--kv_cache_dtype={kv_cache_dtype}"
    if not attention.supports_kv_cache_dtype(kv_cache_dtype):
        return [f"{flag}: {backend} does not store a quantized KV cache of that type "
                f"(supports_kv_cache_dtype({kv_cache_dtype!r}) is False); use --kv_cache_dtype=auto"]
    if is_mla_config(hf_config):
        return [f"{flag}: the checkpoint uses multi-head latent attention (kv_lora_rank={hf_config.kv_lora_rank}), "
                f"whose latent cache is kept in the model dtype (a quantized latent cache is not built); "
                f"use --kv_cache_dtype=auto"]
    return []


def is_mla_config(hf_config: Any) -> bool:
    """A DeepSeek-V2 / V3-style checkpoint: its attention caches a compressed latent per token."""
    return bool(getattr(hf_config, "kv_lora_rank", None)) and hasattr(hf_config, "qk_rope_head_dim")
