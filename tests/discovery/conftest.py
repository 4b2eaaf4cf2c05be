"""A real etcd for the discovery tests (scripts/etcd.sh, one per test session), and apps under
uvicorn in a thread. This folder is a package so that its conftest does not take the module name
`conftest` from tests/conftest.py (test modules elsewhere import helpers from it by that name)."""
from __future__ import annotations

import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "etcd.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Etcd:
    """An etcd on 127.0.0.1:port with its data in data_dir; stop() then start() is a restart."""

    port: int
    data_dir: Path
    running: bool = False

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        out = subprocess.run([str(SCRIPT), "start", "--port", str(self.port), "--data-dir", str(self.data_dir)],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == self.address
        self.running = True

    def stop(self) -> None:
        subprocess.run([str(SCRIPT), "stop", "--data-dir", str(self.data_dir)], check=True, timeout=30)
        self.running = False

    def client(self):
        from heterollm.service.etcd import EtcdClient
        return EtcdClient(self.address)


@pytest.fixture(scope="session")
def etcd(tmp_path_factory) -> Iterator[Etcd]:
    server = Etcd(free_port(), tmp_path_factory.mktemp("etcd"))
    server.start()
    yield server
    if server.running:
        server.stop()


@pytest.fixture
def namespace(request) -> str:
    """A namespace of this test's own in the shared etcd."""
    return f"t-{request.node.name}"[:60].replace("[", "-").replace("]", "")


@contextmanager
def running_app(app, port: int | None = None) -> Iterator[str]:
    """`app` under uvicorn on 127.0.0.1 in a daemon thread; yields its base URL."""
    import uvicorn

    port = port or free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_for(lambda: server.started or not thread.is_alive(), 30, "the app did not start")
    assert thread.is_alive()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(15)


def wait_for(condition: Callable[[], object], timeout: float, what: str, step: float = 0.05):
    """condition()'s first truthy value within `timeout` seconds, else fail with `what`."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} (after {timeout}s)")
        time.sleep(step)


@pytest.fixture(scope="module")
def instance(tiny_llama) -> Iterator[str]:
    """An OpenAI server on a tiny random llama, in this process; its base URL."""
    from heterollm.config import load_config
    from heterollm.engine.llm_engine import LLMEngine
    from heterollm.entrypoints.openai.server import OpenAIServer, ServerSettings

    flags = {"model": str(tiny_llama), "dtype": "float32", "block_size": 8, "num_gpu_blocks_override": 256,
             "max_model_len": 256}
    engine = LLMEngine(load_config([], overrides=flags).config)
    with running_app(OpenAIServer(engine, ServerSettings(served_model_names=["tiny"])).app) as url:
        yield url


def stop_process(proc: subprocess.Popen) -> None:
    """SIGTERM a process started by a test, wait up to 30 s, then kill it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
