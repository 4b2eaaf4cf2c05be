"""The contracts a backend implements: Platform, AttentionBackend, GraphRunner, Communicator, Executor.

A backend distribution declares the contract range it implements in its top-level package
(`__heterollm_api__ = ">=1.0,<2"`); the registry checks it against API_VERSION before it
imports any of the backend's modules.
"""
from heterollm.interfaces.attention import AttentionBackend, AttentionInputs, AttentionMetadata
from heterollm.interfaces.batch import RunnerOutput, SamplingInfo, ScheduledRequest, SchedulerOutput, TokenLogprobs
from heterollm.interfaces.communicator import Communicator
from heterollm.interfaces.component import Component
from heterollm.interfaces.executor import Executor, ExecutorDead
from heterollm.interfaces.graph_runner import GraphRunner
from heterollm.interfaces.platform import Platform
from heterollm.interfaces.step import DecodeInputs, ForwardContext, StepForward, StepInputs

API_VERSION = "1.0"

__all__ = ["API_VERSION", "AttentionBackend", "AttentionInputs", "AttentionMetadata", "RunnerOutput",
           "ScheduledRequest", "SchedulerOutput", "TokenLogprobs", "Communicator", "Component", "Executor",
           "ExecutorDead",
           "GraphRunner", "Platform", "SamplingInfo", "DecodeInputs", "ForwardContext", "StepForward", "StepInputs"]
