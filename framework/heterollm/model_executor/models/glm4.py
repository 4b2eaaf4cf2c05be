"""GLM-4 (GlmForCausalLM: GLM-4-9B's Hugging Face conversion; Glm4ForCausalLM: GLM-4-0414, which
adds a norm after attention and after the MLP): the Llama decoder with q/k/v bias without o_proj
bias, gate/up fused in the checkpoint, and a rotary embedding over half of each head in GLM's
interleaved layout. The interleaved pairs (2i, 2i+1) become the shared decoder's (i, i + rot/2) by
reordering q and k rows at load time: q.k products, and so attention, are unchanged."""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from heterollm.model_executor.layers import RMSNorm
from heterollm.model_executor.models.llama import DecoderLayer, LlamaForCausalLM
from heterollm.model_executor.models.phi3 import unfuse


class Glm4DecoderLayer(DecoderLayer):
    def __init__(self, cfg: Any, idx: int, *args: Any) -> None:
        super().__init__(cfg, idx, *args)
        self.post_self_attn_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_mlp_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @torch.compiler.nested_compile_region
    def finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """DecoderLayer's, with GLM-4's norms after the attention and after the MLP."""
        x = x + self.post_self_attn_layernorm(self.self_attn.output(attn_out))
        return x + self.post_mlp_layernorm(self.mlp(self.post_attention_layernorm(x)))


class GlmForCausalLM(LlamaForCausalLM):
    def biases(self, hf_config: Any) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "attention_bias", True)), False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(self._deinterleave(unfuse(self, weights)))

    def _deinterleave(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """q_proj / k_proj rows (weight and bias), per head: rotary features 0, 2, 4, ... then 1, 3, 5, ...,
        then the features the rotary embedding leaves alone."""
        attn = self.model.layers[0].self_attn
        d, rot = attn.head_dim, attn.rotary_dim
        order = torch.cat([torch.arange(0, rot, 2), torch.arange(1, rot, 2), torch.arange(rot, d)])
        for name, tensor in weights:
            if name.rpartition(".")[0].endswith(("q_proj", "k_proj")):
                tensor = tensor.reshape(-1, d, *tensor.shape[1:])[:, order].reshape(tensor.shape)
            yield name, tensor


class Glm4ForCausalLM(GlmForCausalLM):
    layer_class = Glm4DecoderLayer
