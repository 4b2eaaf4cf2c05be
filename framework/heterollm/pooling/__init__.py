"""Embeddings and scoring on the generation runner: pooling parameters, the pooler the runner calls,
the task a launch resolves to, and the prompt formats of rerankers and cross-encoders."""
from heterollm.pooling.params import PoolingError, PoolingParams, PoolingType

__all__ = ["PoolingError", "PoolingParams", "PoolingType"]
