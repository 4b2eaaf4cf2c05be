"""`heterollm generate` on a tiny model: streaming output and one-line errors."""
from __future__ import annotations

import pytest

from helpers import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def test_generate_prints_text(cli, tiny):
    r = cli("generate", "--model", str(tiny), "--prompt", "Hello", "--max_tokens", "8", "--temperature=0",
            "--ignore_eos", "--dtype=float32", "--num_gpu_blocks_override=32")
    assert r.rc == 0, r.err
    assert r.out.strip() and "8 generated" in r.err and "finish: length" in r.err


@pytest.mark.parametrize("args,needle", [
    (["--prompt", "x", "--temperature=-1"], "--temperature"),
    (["--prompt", "x", "--top_p=0"], "--top_p"),
    (["--max_tokens", "4"], "--prompt is required"),
    (["--prompt", "x", "--stop", "[1"], "--stop"),
    (["--prompt", "one two three four five six", "--max_model_len=4"], "max_model_len"),
])
def test_generate_errors(cli, tiny, args, needle):
    r = cli("generate", "--model", str(tiny), "--dtype=float32", *args)
    assert r.rc == 2, (r.out, r.err)
    assert needle in r.err and "Traceback" not in r.err


def test_generate_bad_model_path(cli, tmp_path):
    r = cli("generate", "--model", str(tmp_path / "missing"), "--prompt", "x")
    assert r.rc == 2 and "does not exist" in r.err and "Traceback" not in r.err
