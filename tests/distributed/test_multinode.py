"""Multi-node launch: two "nodes" as two processes on loopback, joined at --master_node_addr; the
answer equals a one-process run. A node that cannot reach the master gives up after
--max_reconnect_count attempts with a clear error."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import run_cli
from helpers import build_tiny_model
from heterollm.distributed.executor import free_port

pytestmark = pytest.mark.slow  # the default run skips it; CI runs `-m slow` as a second step

GEN = ["--dtype", "float32", "--num_gpu_blocks_override", "64", "--max_model_len", "128", "--max_tokens", "10",
       "--temperature", "0", "--ignore_eos", "--nostream"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def test_two_nodes_on_loopback_answer_like_one(tiny):
    base = ["generate", "--model", str(tiny), "--prompt", "Hello there", *GEN]
    single = run_cli(*base)
    assert single.rc == 0, single.err
    addr = f"127.0.0.1:{free_port()}"
    multi = ["--tp_size", "2", "--nnodes", "2", "--master_node_addr", addr]
    node1 = subprocess.Popen([sys.executable, "-m", "heterollm.entrypoints.cli", *base, *multi, "--node_rank", "1"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        node0 = run_cli(*base, *multi, "--node_rank", "0")
        out1, err1 = node1.communicate(timeout=120)
    finally:
        node1.kill()
    assert node0.rc == 0, node0.err
    assert node0.out == single.out and single.out.strip()
    assert node1.returncode == 0, err1
    assert "node 1 of 2: ranks 1-1 joining tcp://" + addr in err1


def test_unreachable_master_gives_up_after_max_reconnect_count(tiny):
    r = run_cli("serve", "--model", str(tiny), "--tp_size", "2", "--nnodes", "2", "--node_rank", "1",
                "--master_node_addr", f"127.0.0.1:{free_port()}", "--max_reconnect_count", "2", timeout=120)
    assert r.rc == 1
    assert "could not reach the master node" in r.err and "after 2 attempts (--max_reconnect_count)" in r.err


def test_node_layout_is_checked_at_launch(tiny):
    r = run_cli("generate", "--model", str(tiny), "--prompt", "x", "--tp_size", "3", "--nnodes", "2")
    assert r.rc == 2 and "--nnodes=2: must divide --tp_size=3" in r.err
