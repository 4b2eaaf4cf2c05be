"""Images -> pixel patches and placeholder tokens, with transformers' own image processor for the
checkpoint (its `preprocessor_config.json`: Qwen2-VL's resizes to a multiple of 28 pixels within
min/max pixels and flattens 14 x 14 x 2-frame patches).

transformers' combined Qwen2VLProcessor is not used: its video half needs torchvision. What it adds
to the image processor is one step, done here: each image's single `<|image_pad|>` placeholder in
the prompt becomes t * h * w / merge^2 of them (tests/multimodal check the result against that
processor token for token)."""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import xxhash

from heterollm.config import ConfigError
from heterollm.multimodal import MultiModalItem
from heterollm.scheduler.request import RequestRejected

logger = logging.getLogger("heterollm.multimodal")

PIXEL_KWARGS = {"min_pixels": "shortest_edge", "max_pixels": "longest_edge",
                "image_min_pixels": "shortest_edge", "image_max_pixels": "longest_edge"}
"""mm_processor_kwargs understood (vLLM's names and FastDeploy's image_* ones): the pixel budget an
image is resized into."""

MODALITIES = ("image", "video", "audio")
UNSUPPORTED = {"video": "video input is not built (Qwen2-VL's frames go through transformers' video processor, "
                        "which needs torchvision: not a heterollm dependency, and not installable beside the CPU "
                        "torch build heterollm is tested on)",
               "audio": "no served family takes audio"}


def is_multimodal_config(hf_config: Any) -> bool:
    return getattr(hf_config, "vision_config", None) is not None and hasattr(hf_config, "image_token_id")


def image_limit(limit_image_per_prompt: int, limit_mm_per_prompt: Mapping[str, int] | None) -> int:
    """Images a prompt may carry: FastDeploy's `--limit_mm_per_prompt {"image": N}` when given, else
    xLLM's `--limit_image_per_prompt`."""
    if limit_mm_per_prompt and "image" in limit_mm_per_prompt:
        return int(limit_mm_per_prompt["image"])
    return int(limit_image_per_prompt)


def check_limits_flag(value: Mapping[str, Any] | None) -> None:
    """--limit_mm_per_prompt: modalities image / video / audio, each a count >= 0."""
    for key, count in (value or {}).items():
        if key not in MODALITIES:
            raise ConfigError(f"--limit_mm_per_prompt: unknown modality {key!r} (image, video, audio)")
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ConfigError(f"--limit_mm_per_prompt: {key} must be a count >= 0, got {count!r}")


def pixel_kwargs(kwargs: Mapping[str, Any] | None, field: str) -> dict[str, int]:
    """Validated mm_processor_kwargs -> {"shortest_edge": min pixels, "longest_edge": max pixels}.
    `field` names where they came from (the flag, or the request field) in the error."""
    out: dict[str, int] = {}
    for key, value in (kwargs or {}).items():
        if key not in PIXEL_KWARGS:
            raise ValueError(f"{field}: {key!r} is not supported (supported: {', '.join(PIXEL_KWARGS)})")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ValueError(f"{field}: {key} must be a positive pixel count, got {value!r}")
        out[PIXEL_KWARGS[key]] = value
    if out.get("shortest_edge", 0) > out.get("longest_edge", 1 << 62):
        raise ValueError(f"{field}: min_pixels {out['shortest_edge']} is above max_pixels {out['longest_edge']}")
    return out


class MultiModalProcessor:
    """A vision-language checkpoint's image preprocessing: built once per launch, used per request
    (in the API server process under `heterollm serve`, in the engine offline)."""

    def __init__(self, folder: Path, hf_config: Any, tokenizer: Any, max_images: int,
                 processor_kwargs: Mapping[str, Any] | None) -> None:
        from transformers import AutoImageProcessor

        if not (folder / "preprocessor_config.json").is_file():
            raise ConfigError(f"--model: {folder} is a vision-language model but has no preprocessor_config.json "
                              f"(its image processor's settings)")
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(str(folder))
        except Exception as exc:  # transformers raises ValueError / OSError / JSON errors here
            raise ConfigError(f"--model: cannot load the image processor from {folder}: {type(exc).__name__}: "
                              f"{exc}") from None
        try:
            self.defaults = pixel_kwargs(processor_kwargs, "--mm_processor_kwargs")
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        self.tokenizer = tokenizer
        self.image_token_id = int(hf_config.image_token_id)
        self.merge = int(hf_config.vision_config.spatial_merge_size)
        self.max_images = max_images

    def process(self, prompt_ids: Sequence[int], images: Sequence[Any], request_kwargs: Mapping[str, Any] | None = None,
                field: str = "multi_modal_data") -> tuple[list[int], list[MultiModalItem]]:
        """(prompt ids with each image's placeholder expanded, one item per image). The prompt holds
        one placeholder per image (a run of `<|image_pad|>` already expanded to the image's length is
        taken as it is); every mismatch is a RequestRejected naming `field`."""
        self.check_count(len(images), field)
        runs = self._placeholder_runs(prompt_ids)
        if len(runs) != len(images):
            raise RequestRejected(field, f"the prompt has {len(runs)} image placeholder(s) but {len(images)} image(s) "
                                         f"were given (each image needs one <|vision_start|><|image_pad|>"
                                         f"<|vision_end|> in the prompt)")
        if not images:
            return list(prompt_ids), []
        try:
            size = {**self.defaults, **pixel_kwargs(request_kwargs, "mm_processor_kwargs")}
        except ValueError as exc:
            raise RequestRejected("mm_processor_kwargs", str(exc)) from None
        kwargs = {"size": {**self._default_size(), **size}} if size else {}
        try:
            out = self.image_processor(images=list(images), return_tensors="pt", **kwargs)
        except Exception as exc:  # a PIL / numpy error on a degenerate image (e.g. 1 pixel high)
            raise RequestRejected(field, f"the image processor refused an image: {type(exc).__name__}: {exc}") from None
        pixels, grids = out["pixel_values"], [tuple(int(v) for v in g) for g in out["image_grid_thw"].tolist()]
        ids: list[int] = []
        items: list[MultiModalItem] = []
        cursor = first = 0
        for (start, end), grid in zip(runs, grids):
            length = grid[0] * grid[1] * grid[2] // (self.merge * self.merge)
            if end - start not in (1, length):
                raise RequestRejected(field, f"a run of {end - start} image placeholder tokens does not match its "
                                             f"image's {length} tokens")
            ids += prompt_ids[cursor:start]
            patches = grid[0] * grid[1] * grid[2]
            pv = pixels[first:first + patches].float().contiguous()
            first += patches
            items.append(MultiModalItem("image", _content_hash(pv, grid), len(ids), length, grid, pv))
            ids += [self.image_token_id] * length
            cursor = end
        ids += prompt_ids[cursor:]
        return ids, items

    def check_count(self, count: int, field: str) -> None:
        """A RequestRejected naming `field` when a prompt brings more images than the launch allows."""
        if count > self.max_images:
            raise RequestRejected(field, f"{count} images exceed this server's limit of {self.max_images} per "
                                         f"prompt (--limit_image_per_prompt / --limit_mm_per_prompt)")

    def _placeholder_runs(self, ids: Sequence[int]) -> list[tuple[int, int]]:
        runs, i = [], 0
        while i < len(ids):
            if ids[i] == self.image_token_id:
                j = i
                while j < len(ids) and ids[j] == self.image_token_id:
                    j += 1
                runs.append((i, j))
                i = j
            else:
                i += 1
        return runs

    def _default_size(self) -> dict[str, int]:
        size = getattr(self.image_processor, "size", None) or {}
        get = size.get if isinstance(size, dict) else lambda k: getattr(size, k, None)
        return {k: int(get(k)) for k in ("shortest_edge", "longest_edge") if get(k)}


def _content_hash(pixels: Any, grid: tuple[int, int, int]) -> str:
    h = xxhash.xxh3_128()
    h.update(json.dumps(grid).encode())
    h.update(pixels.numpy().tobytes())
    return h.hexdigest()


def check_launch_flags(config: Any, hf_config: Any) -> None:
    """The multimodal flags against the model: on a text-only model a multimodal flag set away from
    its default is an error naming it (never silently ignored); so is --backend naming the other kind."""
    vlm = is_multimodal_config(hf_config)
    model, fd = config.model, config.fastdeploy
    problems = []
    if model.backend == "vlm" and not vlm:
        problems.append("--backend=vlm: the model is text-only (no vision_config); use --backend=llm or leave it empty")
    if model.backend == "llm" and vlm:
        problems.append("--backend=llm: the model is a vision-language model; use --backend=vlm or leave it empty")
    if not vlm:
        spec = {"limit_image_per_prompt": (model.limit_image_per_prompt, 8),
                "max_encoder_cache_size": (model.max_encoder_cache_size, 0),
                "mm_processor_kwargs": (fd.mm_processor_kwargs, None), "limit_mm_per_prompt": (fd.limit_mm_per_prompt, None),
                "enable_mm": (fd.enable_mm, False), "enable_mm_encoder_dp": (config.parallel.enable_mm_encoder_dp, False)}
        problems += [f"--{name}: the model is text-only; this flag is for vision-language models"
                     for name, (value, default) in spec.items() if value != default]
    elif config.parallel.enable_mm_encoder_dp and config.parallel.tp_size < 2:
        problems.append("--enable_mm_encoder_dp: needs --tp_size > 1 (it splits the images among the tensor-parallel "
                        "ranks; one rank encodes every image anyway)")
    try:
        check_limits_flag(fd.limit_mm_per_prompt)
    except ConfigError as exc:
        problems.append(str(exc))
    if problems:
        raise ConfigError("; ".join(problems))


class MultiModalInputs:
    """What a launch does with a request's `multi_modal_data`: load each image (media.py, with
    --mm_download_headers), preprocess it and expand its placeholder (MultiModalProcessor). A
    text-only model refuses images, naming the field."""

    def __init__(self, processor: MultiModalProcessor | None, policy: Any, model_name: str) -> None:
        self.processor = processor
        self.policy = policy
        self.model_name = model_name

    @classmethod
    def for_launch(cls, config: Any, source: Any, tokenizer: Any) -> MultiModalInputs:
        from heterollm.multimodal.media import FetchPolicy, parse_download_headers

        try:
            headers = parse_download_headers(config.model.mm_download_headers)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        check_launch_flags(config, source.hf_config)
        processor = None
        if is_multimodal_config(source.hf_config):
            limit = image_limit(config.model.limit_image_per_prompt, config.fastdeploy.limit_mm_per_prompt)
            processor = MultiModalProcessor(source.folder, source.hf_config, tokenizer, limit,
                                            config.fastdeploy.mm_processor_kwargs)
        return cls(processor, FetchPolicy(headers=headers), str(source.gguf_file or source.folder))

    def refuse_if_text_only(self, images: Sequence[Any], field: str) -> None:
        """A RequestRejected naming `field` when images come to a text-only model."""
        if images and self.processor is None:
            raise RequestRejected(field, f"the model {self.model_name} is text-only: it takes no images (serve a "
                                         f"vision-language model, e.g. Qwen2-VL)")

    def admit(self, prompt_ids: list[int], data: Mapping[str, Any] | None, kwargs: Mapping[str, Any] | None = None,
              field: str = "multi_modal_data", headers: Mapping[str, str] | None = None) -> tuple[list[int], list[MultiModalItem]]:
        """(expanded prompt ids, items) for a prompt and its `multi_modal_data` ({"image": one image or a
        list: PIL images, bytes, data: or http(s) URLs}); a RequestRejected naming the field otherwise."""
        from heterollm.multimodal.media import load_image

        data = dict(data or {})
        for key in data:
            if key != "image":
                raise RequestRejected(f"{field}.{key}", f"{key} input is not supported (images only): "
                                                        f"{UNSUPPORTED.get(key, 'no served family takes it')}")
        images = data.get("image")
        if images is None:
            images = []
        elif not isinstance(images, (list, tuple)):
            images = [images]
        if self.processor is None:
            self.refuse_if_text_only(images, f"{field}.image")
            return list(prompt_ids), []
        self.processor.check_count(len(images), f"{field}.image")  # before fetching any of them
        loaded = [load_image(img, f"{field}.image.{i}", self.policy, headers) for i, img in enumerate(images)]
        return self.processor.process(prompt_ids, loaded, kwargs, f"{field}.image")


def split_images(messages: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[Any]]:
    """A conversation's image parts, in order, and the conversation as the chat template sees it:
    each image part ({"type": "image_url", "image_url": {"url": ...}}, or {"type": "image", "image": a
    PIL image / bytes / URL}) becomes {"type": "image"}, which the template renders as the
    placeholder. Messages without parts come back as they are."""
    images: list[Any] = []
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        parts = []
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image_url":
                url = part.get("image_url")
                images.append(url.get("url") if isinstance(url, dict) else url)
                parts.append({"type": "image"})
            elif kind == "image":
                images.append(part.get("image"))
                parts.append({"type": "image"})
            else:
                parts.append(part)
        out.append({**message, "content": parts})
    return out, images
