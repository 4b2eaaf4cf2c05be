"""heterollm: an LLM inference and serving engine for heterogeneous accelerators.

`from heterollm import LLM, SamplingParams` for offline use (`PoolingParams` for `LLM.embed`); the
`heterollm` command to serve.
"""
from typing import Any

from heterollm.interfaces import API_VERSION as __heterollm_api__  # noqa: F401  the contract the core implements

__version__ = "0.1.0"
__all__ = ["LLM", "PoolingParams", "SamplingParams", "__version__"]


def __getattr__(name: str) -> Any:  # lazy: `import heterollm` stays light (no torch) for the CLI and registry
    if name == "LLM":
        from heterollm.engine.llm import LLM
        return LLM
    if name == "PoolingParams":
        from heterollm.pooling import PoolingParams
        return PoolingParams
    if name == "SamplingParams":
        from heterollm.sampling import SamplingParams
        return SamplingParams
    raise AttributeError(name)
