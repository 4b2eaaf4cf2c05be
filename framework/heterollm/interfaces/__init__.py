"""The contracts a backend implements: Platform, AttentionBackend, GraphRunner, Communicator, Executor,
and the one `Backend` descriptor a backend wheel registers.

A backend's descriptor declares the contract range it implements (`api_version=">=2.0,<3"`); the
registry checks it against API_VERSION before it imports any class the descriptor names.
"""
from heterollm.interfaces.attention import AttentionBackend, AttentionInputs, AttentionMetadata
from heterollm.interfaces.backend import Backend
from heterollm.interfaces.batch import RunnerOutput, SamplingInfo, ScheduledRequest, SchedulerOutput, TokenLogprobs
from heterollm.interfaces.communicator import Communicator
from heterollm.interfaces.component import Component
from heterollm.interfaces.executor import Executor, ExecutorDead
from heterollm.interfaces.graph_runner import GraphRunner
from heterollm.interfaces.kv_connector import KVConnector, KVTransfers
from heterollm.interfaces.platform import Platform, TraceProfiler
from heterollm.interfaces.step import DecodeInputs, ForwardContext, StepForward, StepInputs

API_VERSION = "2.0"
"""2.0: one Backend descriptor per wheel (group heterollm.backends) replaced the per-group entry points."""

__all__ = ["API_VERSION", "AttentionBackend", "Backend", "AttentionInputs", "AttentionMetadata", "RunnerOutput",
           "ScheduledRequest", "SchedulerOutput", "TokenLogprobs", "Communicator", "Component", "Executor",
           "ExecutorDead", "KVConnector", "KVTransfers",
           "GraphRunner", "Platform", "TraceProfiler", "SamplingInfo", "DecodeInputs", "ForwardContext", "StepForward", "StepInputs"]
