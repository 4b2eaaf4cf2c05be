"""heterollm's CPU backend, the reference every other backend is tested against.

This module stays import-light (no torch): the registry reads `BACKEND.api_version` before it
imports any class the descriptor names.
"""
from heterollm.interfaces.backend import Backend

__version__ = "0.1.0"

BACKEND = Backend(
    name="cpu",
    api_version=">=2.0,<3",
    platform="heterollm_cpu.platform:CpuPlatform",
    components={
        "attention": "heterollm_cpu.attention:CpuPagedAttention",
        "graph_runners": "heterollm_cpu.graph_runner:CpuGraphRunner",
        "communicators": "heterollm_cpu.communicator:GlooCommunicator",
        "executors": "heterollm.model_executor.executor:InProcessExecutor",
    },
    unsupported={
        "enable_graph_mode_decode_no_padding": "device graphs only: the CPU graph (torch.compile) has dynamic "
                                               "shapes and never pads a batch",
    },
    register_ops="heterollm_cpu.fused:register_ops",
)
