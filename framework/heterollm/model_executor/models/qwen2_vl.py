"""Qwen2-VL and Qwen2.5-VL: a vision transformer whose merged patch embeddings replace the prompt's
image placeholder tokens, then the Qwen2 decoder with multimodal rotary positions (M-RoPE: each
rotary frequency turns by the token's temporal, height or width index, per `mrope_section`).

The encoder runs in the prefill step that first reaches an image (model_executor/mm_encoder.py
batches and caches it); images are preprocessed by transformers' own processor for the family
(heterollm/multimodal/processor.py). The encoder is replicated on every tensor-parallel rank."""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from heterollm.model_executor.layers import ForwardContext, RotaryEmbedding
from heterollm.model_executor.models.llama import Qwen2ForCausalLM
from heterollm.model_executor.parallel import ParallelContext


# -- the vision tower --------------------------------------------------------------------------
def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class VisionRMSNorm(nn.Module):
    """Qwen2.5-VL's RMSNorm: computed in fp32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _norm(rms: bool, dim: int) -> nn.Module:
    return VisionRMSNorm(dim) if rms else nn.LayerNorm(dim, eps=1e-6)


def _activation(name: str):
    if name == "quick_gelu":
        return lambda x: x * torch.sigmoid(1.702 * x)
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return (lambda x: F.gelu(x, approximate="tanh")) if name.endswith("tanh") else F.gelu
    raise ValueError(f"vision hidden_act {name!r} is not supported (quick_gelu, silu, gelu)")


class VisionAttention(nn.Module):
    """Bidirectional attention within each segment of `cu_seqlens` (an image, or a window of one)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: list[int]) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.heads, -1).unbind(1)
        cos, sin = rope  # (n, head_dim) fp32: the rotation in fp32, as the reference does
        q = (q.float() * cos[:, None] + _rotate_half(q.float()) * sin[:, None]).to(x.dtype)
        k = (k.float() * cos[:, None] + _rotate_half(k.float()) * sin[:, None]).to(x.dtype)
        out = torch.empty_like(q)
        for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            out[a:b] = F.scaled_dot_product_attention(q[a:b].transpose(0, 1), k[a:b].transpose(0, 1),
                                                      v[a:b].transpose(0, 1)).transpose(0, 1)
        return self.proj(out.reshape(n, -1))


class VisionMlp(nn.Module):
    """Qwen2-VL: fc1 -> act -> fc2."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionGatedMlp(nn.Module):
    """Qwen2.5-VL: down(act(gate(x)) * up(x)), every projection with a bias."""

    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden)
        self.up_proj = nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = _activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp: nn.Module, rms: bool) -> None:
        super().__init__()
        self.norm1 = _norm(rms, dim)
        self.norm2 = _norm(rms, dim)
        self.attn = VisionAttention(dim, heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], cu_seqlens: list[int]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), rope, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Each 2 x 2 (spatial_merge_size^2) group of neighbouring patches -> one language-model token."""

    def __init__(self, out_dim: int, dim: int, merge: int, rms: bool) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = _norm(rms, dim)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class PatchEmbed(nn.Module):
    """A Conv3d whose stride equals its kernel: one matrix product over each flattened patch."""

    def __init__(self, channels: int, temporal: int, patch: int, dim: int) -> None:
        super().__init__()
        self.proj = nn.Conv3d(channels, dim, kernel_size=(temporal, patch, patch), stride=(temporal, patch, patch),
                              bias=False)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return pixels.to(w.dtype) @ w.view(w.shape[0], -1).t()


class VisionTransformer(nn.Module):
    """Qwen2-VL's (`windowed=False`: LayerNorm, fc1/fc2 MLP, full attention per image) or Qwen2.5-VL's
    (`windowed=True`: RMSNorm, gated MLP, attention within windows of `window_size` pixels except in
    the `fullatt_block_indexes` blocks) vision tower. Input: the processor's flattened patches of
    every image, concatenated; output: one embedding per merged patch, in the same image order."""

    def __init__(self, vcfg: Any, windowed: bool) -> None:
        super().__init__()
        self.windowed = windowed
        dim = vcfg.hidden_size if windowed else vcfg.embed_dim
        out_dim = vcfg.out_hidden_size if windowed else vcfg.hidden_size
        heads = vcfg.num_heads
        self.merge = vcfg.spatial_merge_size
        self.patch_size = vcfg.patch_size
        self.window_size = getattr(vcfg, "window_size", 0)
        self.full_blocks = set(getattr(vcfg, "fullatt_block_indexes", None) or [])
        self.patch_embed = PatchEmbed(vcfg.in_channels, vcfg.temporal_patch_size, vcfg.patch_size, dim)
        head_dim = dim // heads
        theta = (getattr(vcfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        quarter = head_dim // 2
        self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, quarter, 2, dtype=torch.float) / quarter),
                             persistent=False)

        def mlp() -> nn.Module:
            if windowed:
                return VisionGatedMlp(dim, vcfg.intermediate_size, vcfg.hidden_act)
            return VisionMlp(dim, int(dim * vcfg.mlp_ratio), vcfg.hidden_act)

        self.blocks = nn.ModuleList(VisionBlock(dim, heads, mlp(), windowed) for _ in range(vcfg.depth))
        self.merger = PatchMerger(out_dim, dim, self.merge, windowed)

    def forward(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> torch.Tensor:
        x = self.patch_embed(pixels)
        rope = self._rope(grids)
        full = _cu_seqlens([h * w for t, h, w in grids for _ in range(t)])
        if not self.windowed:
            for block in self.blocks:
                x = block(x, rope, full)
            return self.merger(x)
        order, windows = self._windows(grids)
        unit = self.merge * self.merge
        x = x.view(-1, unit, x.shape[-1])[order].flatten(0, 1)
        rope = tuple(r.view(-1, unit, r.shape[-1])[order].flatten(0, 1) for r in rope)
        for i, block in enumerate(self.blocks):
            x = block(x, rope, full if i in self.full_blocks else windows)
        return self.merger(x)[torch.argsort(order)]

    def _rope(self, grids: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), each (patches, head_dim) fp32: half the frequencies turn with the patch's row,
        half with its column; patches are laid out merge-group by merge-group, as the processor does."""
        m = self.merge
        rows = []
        for t, h, w in grids:
            hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
            shape = (h // m, m, w // m, m)
            pos = torch.stack([hh.reshape(shape).transpose(1, 2).flatten(), ww.reshape(shape).transpose(1, 2).flatten()],
                              dim=-1)
            rows.append(pos.repeat(t, 1))
        pos = torch.cat(rows).to(self.inv_freq.device)
        freqs = (pos[..., None].float() * self.inv_freq).flatten(1)  # (n, head_dim / 2): rows' then columns'
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()

    def _windows(self, grids: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the merge groups reordered window by window (windows of window_size pixels, row
        major, the last ones cut at the image's edge), and the windows' cumulative patch counts."""
        side = self.window_size // self.merge // self.patch_size
        unit = self.merge * self.merge
        order, bounds, base = [], [0], 0
        for t, h, w in grids:
            gh, gw = h // self.merge, w // self.merge
            index = torch.arange(t * gh * gw).view(t, gh, gw)
            for f in range(t):
                for r in range(0, gh, side):
                    for c in range(0, gw, side):
                        win = index[f, r:r + side, c:c + side].flatten()
                        order.append(win + base)
                        bounds.append(bounds[-1] + win.numel() * unit)
            base += t * gh * gw
        return torch.cat(order).to(self.inv_freq.device), bounds


def _cu_seqlens(lengths: Iterable[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


# -- M-RoPE ------------------------------------------------------------------------------------
class MRotaryEmbedding(RotaryEmbedding):
    """Rotary embedding over (3, tokens) positions: frequency f turns by the temporal, height or
    width index as `mrope_section` assigns it (sections of the head_dim / 2 frequencies, in that
    order). Positions of shape (tokens,) are text positions: all three indices equal."""

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int) -> None:
        super().__init__(hf_config, head_dim, max_positions)
        params = getattr(hf_config, "rope_parameters", None) or {}
        section = params.get("mrope_section") or getattr(hf_config, "mrope_section", None) or [16, 24, 24]
        if sum(section) != head_dim // 2:
            raise ValueError(f"mrope_section {section} does not cover head_dim / 2 = {head_dim // 2} frequencies")
        which = torch.cat([torch.full((n,), i) for i, n in enumerate(section)])
        self.register_buffer("section_of", which.to(self.cos.device), persistent=False)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if positions.dim() == 1:
            return super().lookup(positions)
        index = self.section_of[None, None, :].expand(1, positions.shape[1], -1)
        return (self.cos[positions].gather(0, index)[0], self.sin[positions].gather(0, index)[0])


# -- the model ---------------------------------------------------------------------------------
class Qwen2VLForConditionalGeneration(Qwen2ForCausalLM):
    windowed = False

    def __init__(self, hf_config: Any, pctx: ParallelContext, max_positions: int) -> None:
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        if text is not hf_config:  # the top level says whether the LM head is the embedding
            text.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        super().__init__(text, pctx, max_positions)
        self.hf_config = hf_config
        lm = self.model
        head_dim = lm.layers[0].self_attn.head_dim
        lm.rotary = MRotaryEmbedding(text, head_dim, max_positions)
        for layer in lm.layers:
            layer.self_attn.rotary = lm.rotary
        self.visual = VisionTransformer(hf_config.vision_config, self.windowed)
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = hf_config.vision_config.spatial_merge_size

    # the runner's multimodal hooks (model_executor/mm_encoder.py)
    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def encode_images(self, pixels: torch.Tensor, grids: Sequence[tuple[int, int, int]]) -> list[torch.Tensor]:
        """Each image's placeholder embeddings, (t * h * w / merge^2, hidden), from one encoder pass."""
        out = self.visual(pixels.to(self.visual.patch_embed.proj.weight.dtype), grids)
        return list(out.split([t * h * w // (self.merge * self.merge) for t, h, w in grids]))

    def mrope_positions(self, num_prompt: int, spans: Sequence[tuple[int, tuple[int, int, int]]]) -> tuple[torch.Tensor, int]:
        """(3, num_prompt) positions of the prompt, and the offset of the tokens after it (position =
        index + delta): text counts on from the last position; an image at `offset` with grid
        (t, h, w) spans t x h/merge x w/merge tokens indexed by (frame, row, column) from where the
        text stood, and the text after it resumes past its largest index."""
        parts, pos, cursor = [], 0, 0
        for offset, (t, h, w) in spans:
            if offset > cursor:
                parts.append(torch.arange(offset - cursor).expand(3, -1) + pos)
                pos += offset - cursor
            gh, gw = h // self.merge, w // self.merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(gh), torch.arange(gw), indexing="ij")
            parts.append(torch.stack([tt, hh, ww]).reshape(3, -1) + pos)
            pos += max(gh, gw)
            cursor = offset + t * gh * gw
        if num_prompt > cursor:
            parts.append(torch.arange(num_prompt - cursor).expand(3, -1) + pos)
            pos += num_prompt - cursor
        positions = torch.cat(parts, dim=1) if parts else torch.zeros(3, 0, dtype=torch.long)
        return positions, pos - num_prompt

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        lm = self.model
        x = lm.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        rope = lm.rotary.lookup(positions)
        for layer in lm.layers:
            x = layer(rope, x, ctx)
        return lm.norm(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Both layouts transformers writes: `visual.*` / `model.*` and `model.visual.*` /
        `model.language_model.*`; the vision tower's tensors are copied as they are."""
        own = dict(self.visual.named_parameters())
        loaded: set[str] = set()

        def text_weights() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                name = name.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1)
                if name.startswith("visual."):
                    key = name.removeprefix("visual.")
                    param = own.get(key)
                    if param is None or param.shape != tensor.shape:
                        raise KeyError(name)
                    with torch.no_grad():
                        param.copy_(tensor.to(param.dtype))
                    loaded.add(name)
                    continue
                yield name, tensor

        return super().load_weights(text_weights()) | loaded


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    windowed = True
