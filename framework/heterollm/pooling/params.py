"""What a pooling request asks of the runner: how to pool the final hidden states (last token,
mean, first token), and what to do with the pooled vector (an embedding, or a relevance score)."""
from __future__ import annotations

import enum
from dataclasses import dataclass


class PoolingError(ValueError):
    """A bad pooling parameter; `field` names it (HTTP 400)."""

    def __init__(self, field_name: str, message: str) -> None:
        self.field = field_name
        super().__init__(f"{field_name}: {message}")


class PoolingType(str, enum.Enum):
    LAST = "LAST"
    """The last prompt token's hidden state (decoder embedding models: Qwen3-Embedding, e5-mistral)."""
    MEAN = "MEAN"
    """The mean over every prompt position."""
    CLS = "CLS"
    """The first position's hidden state."""

    @classmethod
    def parse(cls, value: str | PoolingType, field_name: str = "pooling_type") -> PoolingType:
        try:
            return cls(str(value.value if isinstance(value, PoolingType) else value).upper())
        except ValueError:
            raise PoolingError(field_name, f"{value!r} is not one of LAST, MEAN, CLS") from None


@dataclass(frozen=True)
class PoolingParams:
    """Per request. `task` "embed": the pooled hidden state, truncated to `dimensions` (Matryoshka),
    then L2-normalized when `normalize`. `task` "score": the model's logits at the last position,
    turned into one relevance probability: softmax over `score_token_ids` (the "no" and "yes" tokens
    of a Qwen3-Reranker, the probability of the last one), or the sigmoid of a one-label
    classification head (a *ForSequenceClassification cross-encoder)."""

    task: str = "embed"
    pooling_type: PoolingType | None = None
    """None: the launch's default (--pooler_config, the checkpoint's sentence-transformers config, LAST)."""
    normalize: bool | None = None
    """None: the launch's default (True unless --pooler_config says otherwise)."""
    dimensions: int | None = None
    score_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.task not in ("embed", "score"):
            raise PoolingError("task", f"{self.task!r} is not embed or score")
        if self.pooling_type is not None:
            object.__setattr__(self, "pooling_type", PoolingType.parse(self.pooling_type))
        if self.dimensions is not None and (isinstance(self.dimensions, bool) or not isinstance(self.dimensions, int)
                                            or self.dimensions < 1):
            raise PoolingError("dimensions", f"must be a positive integer, got {self.dimensions!r}")

    @property
    def needs_every_position(self) -> bool:
        """Whether the pooled value reads positions before the last one (MEAN, CLS): such a request
        computes its whole prompt, bypassing the prefix cache, whose cached positions leave no
        hidden states behind."""
        return self.task == "embed" and self.pooling_type is not PoolingType.LAST
