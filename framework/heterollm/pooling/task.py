"""What a launch serves, resolved once from the flags and the checkpoint: generation, embeddings
(`--task embed`, FastDeploy's `--runner pooling`), and relevance scores (`--enable_qwen3_reranker`,
a one-label *ForSequenceClassification cross-encoder, or the cosine of two embeddings)."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from heterollm.config import ConfigError, HeterollmConfig
from heterollm.pooling.params import PoolingError, PoolingParams, PoolingType
from heterollm.scheduler.request import RequestRejected

logger = logging.getLogger("heterollm.pooling")

RERANKER_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen3ForSequenceClassification")


@dataclass(frozen=True)
class PoolingSetup:
    task: str
    """"generate" or "embed"."""
    architecture: str
    pooling_type: PoolingType
    normalize: bool
    hidden_size: int
    reranker: bool = False
    """--enable_qwen3_reranker: pairs go through Qwen3-Reranker's template (pooling/scoring.py)."""
    num_labels: int | None = None
    """A *ForSequenceClassification checkpoint's classification head (None: a causal LM)."""
    score_token_ids: tuple[int, int] | None = None
    """The reranker's ("no", "yes") token ids, scored from the LM head's logits."""
    matryoshka_dimensions: tuple[int, ...] | None = None

    @property
    def is_classifier(self) -> bool:
        return self.num_labels is not None

    @property
    def scores_by_model(self) -> bool:
        """/v1/score and /v1/rerank run the model on each pair (else: the cosine of two embeddings)."""
        return self.reranker or self.is_classifier

    def generation_refusal(self) -> str | None:
        """Why this launch cannot generate text (None: it can)."""
        if self.is_classifier:
            return (f"this model is a {self.architecture} (a classification head, no language-model head): it serves "
                    f"/v1/score and /v1/rerank, not generation")
        if self.task != "generate":
            return (f"this launch runs --task {self.task}: it serves embeddings (/v1/embeddings, /v1/score, "
                    f"/v1/rerank), not generation; start it with --task generate to generate text")
        return None

    def embedding_refusal(self) -> str | None:
        """Why this launch does not serve embeddings (None: it does)."""
        if self.task != "embed":
            return (f"this launch runs --task {self.task}: embeddings need a launch with --task embed "
                    f"(FastDeploy: --runner pooling)")
        return None

    def scoring_refusal(self) -> str | None:
        if self.scores_by_model or self.task == "embed":
            return None
        return ("scoring needs --enable_qwen3_reranker (a Qwen3-Reranker checkpoint), a *ForSequenceClassification "
                f"cross-encoder, or --task embed (cosine of embeddings); this launch runs --task {self.task} "
                f"with {self.architecture}")

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """The request's params with the launch's defaults filled in; RequestRejected when this launch
        cannot serve them."""
        refusal = self.embedding_refusal() if params.task == "embed" else self.scoring_refusal()
        if refusal is not None:
            raise RequestRejected("task", refusal)
        if params.task == "score":
            return replace(params, pooling_type=PoolingType.LAST, score_token_ids=self.score_token_ids)
        self._check_dimensions(params.dimensions)
        return replace(params, pooling_type=params.pooling_type or self.pooling_type,
                       normalize=self.normalize if params.normalize is None else params.normalize)

    def _check_dimensions(self, dimensions: int | None) -> None:
        if dimensions is None:
            return
        allowed = self.matryoshka_dimensions
        if allowed is not None and dimensions not in allowed:
            raise RequestRejected("dimensions", f"this model's Matryoshka dimensions are {list(allowed)}; "
                                                f"got {dimensions}")
        if dimensions > self.hidden_size:
            raise RequestRejected("dimensions", f"dimensions={dimensions} is more than the model's hidden size "
                                                f"{self.hidden_size}")


def resolve_task(config: HeterollmConfig) -> str:
    """--task, or FastDeploy's --runner (pooling = embed); ConfigError when they disagree."""
    task, fd = config.model.task, config.fastdeploy
    if fd.runner == "pooling":
        if task not in ("generate", "embed"):
            raise ConfigError(f"--runner=pooling and --task={task} disagree; give one of them")
        return "embed"
    if fd.runner == "generate" and task != "generate":
        raise ConfigError(f"--runner=generate and --task={task} disagree; give one of them")
    if fd.convert not in ("auto", "none") and task != "embed":
        raise ConfigError(f"--convert={fd.convert} converts a model for pooling: it needs --runner pooling "
                          "(or --task embed)")
    return task


def build_setup(config: HeterollmConfig, hf_config: Any, folder: Path | None, tokenizer: Any,
                architecture: str) -> PoolingSetup:
    """The launch's PoolingSetup; ConfigError naming the flag when the model cannot serve it."""
    task = resolve_task(config)
    pooling_type, normalize = _pooling_defaults(config, folder)
    is_classifier = architecture.endswith("ForSequenceClassification")
    num_labels = int(getattr(hf_config, "num_labels", 1)) if is_classifier else None
    if num_labels is not None and num_labels != 1:
        raise ConfigError(f"--model: {architecture} with {num_labels} labels; heterollm scores with one-label "
                          "cross-encoders (a relevance logit) only")
    reranker = config.model.enable_qwen3_reranker
    token_ids = None
    if reranker:
        if architecture not in RERANKER_ARCHITECTURES:
            raise ConfigError(f"--enable_qwen3_reranker: the model is a {architecture}; Qwen3-Reranker checkpoints "
                              f"are {' or '.join(RERANKER_ARCHITECTURES)}")
        if not is_classifier:
            token_ids = _yes_no_ids(tokenizer)
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    return PoolingSetup(task, architecture, pooling_type, normalize, int(hf_config.hidden_size), reranker,
                        num_labels, token_ids, tuple(int(d) for d in dims) if dims else None)


def _yes_no_ids(tokenizer: Any) -> tuple[int, int]:
    ids = []
    for word in ("no", "yes"):
        token_id = tokenizer.convert_tokens_to_ids(word)
        if token_id is None or token_id == tokenizer.unk_token_id:
            raise ConfigError(f"--enable_qwen3_reranker: the tokenizer has no single {word!r} token")
        ids.append(int(token_id))
    return ids[0], ids[1]


def _pooling_defaults(config: HeterollmConfig, folder: Path | None) -> tuple[PoolingType, bool]:
    """--pooler_config, else the checkpoint's sentence-transformers modules (1_Pooling/config.json,
    a Normalize module), else LAST + normalize (vLLM's and FastDeploy's default for decoder models)."""
    pooling_type, normalize = PoolingType.LAST, True
    st = _sentence_transformers(folder) if folder is not None else None
    if st is not None:
        pooling_type, normalize = st
    given = config.fastdeploy.pooler_config or {}
    unknown = sorted(set(given) - {"pooling_type", "normalize"})
    if unknown:
        raise ConfigError(f"--pooler_config: unknown key(s) {unknown}; it takes pooling_type (LAST, MEAN, CLS) "
                          "and normalize (true/false)")
    try:
        if "pooling_type" in given:
            pooling_type = PoolingType.parse(given["pooling_type"])
    except PoolingError as exc:
        raise ConfigError(f"--pooler_config: {exc}") from None
    if "normalize" in given:
        if not isinstance(given["normalize"], bool):
            raise ConfigError("--pooler_config: normalize must be true or false")
        normalize = given["normalize"]
    return pooling_type, normalize


def _sentence_transformers(folder: Path) -> tuple[PoolingType, bool] | None:
    """The pooling a sentence-transformers checkpoint declares (modules.json), or None."""
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return None
    try:
        modules = json.loads(modules_file.read_text())
        types = {m.get("type", "").rsplit(".", 1)[-1]: m.get("path", "") for m in modules}
        pooling = json.loads((folder / types["Pooling"] / "config.json").read_text()) if "Pooling" in types else {}
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        logger.warning("ignoring %s: %s", modules_file, exc)
        return None
    if pooling.get("pooling_mode_lasttoken"):
        kind = PoolingType.LAST
    elif pooling.get("pooling_mode_cls_token"):
        kind = PoolingType.CLS
    elif pooling.get("pooling_mode_mean_tokens"):
        kind = PoolingType.MEAN
    else:
        kind = PoolingType.LAST
    return kind, "Normalize" in types
