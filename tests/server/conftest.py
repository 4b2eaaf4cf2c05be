"""A real server for the tests: uvicorn on a free local port, in a thread, around an engine
built on a tiny random llama (its tokenizer and chat template are SmolLM2's)."""
from __future__ import annotations

import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

from heterollm.config import load_config
from heterollm.engine.llm_engine import LLMEngine
from heterollm.entrypoints.openai.server import OpenAIServer, ServerSettings

MODEL = "tiny-llama"


@dataclass
class Running:
    url: str
    server: OpenAIServer

    @property
    def engine(self) -> LLMEngine:
        return self.server.engine


def spawned_children(pid: int) -> list[int]:
    """The multiprocessing-spawned children of process `pid` (engine cores, tensor-parallel ranks)."""
    lines = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True,
                           text=True).stdout.splitlines()
    return [int(line.split()[0]) for line in lines if "spawn_main" in line]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(engine: LLMEngine, **settings) -> Iterator[Running]:
    import uvicorn

    app_server = OpenAIServer(engine, ServerSettings(served_model_names=[MODEL], **settings))
    port = free_port()
    config = uvicorn.Config(app_server.app, host="127.0.0.1", port=port, log_level="warning",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the test server did not start")
        time.sleep(0.05)
    try:
        yield Running(f"http://127.0.0.1:{port}", app_server)
    finally:
        server.should_exit = True
        thread.join(30)


@contextmanager
def serving_cores(config) -> Iterator[Running]:
    """`config` served by engine-core processes (heterollm serve's split), shut down after."""
    from heterollm.engine.core_client import start_engine_cores

    clients = start_engine_cores(config)
    try:
        with serving(clients) as running:
            yield running
    finally:
        for c in clients:
            c.shutdown()


def make_engine(folder, **flags) -> LLMEngine:
    flags = {"dtype": "float32", "block_size": 8, "num_gpu_blocks_override": 512, "max_model_len": 256, **flags}
    return LLMEngine(load_config([], overrides={"model": str(folder), **flags}).config)


@pytest.fixture(scope="module")
def srv(tiny_llama) -> Iterator[Running]:
    with serving(make_engine(tiny_llama)) as running:
        yield running
