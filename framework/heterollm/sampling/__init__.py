"""Sampling: per-request parameters, the batch sampler, and structured output (xgrammar)."""
from heterollm.sampling.params import SamplingParams, SamplingParamsError
from heterollm.sampling.structured import StructuredOutputError, StructuredOutputsParams

__all__ = ["SamplingParams", "SamplingParamsError", "StructuredOutputError", "StructuredOutputsParams"]
