"""The CPU graph runner (`--enable_graph` on CPU): decode-only steps run through torch.compile and
give the eager engine's tokens and logprobs."""
from __future__ import annotations

import pytest
import torch

from heterollm import LLM, SamplingParams
from heterollm.config import load_config
from heterollm_cpu.graph_runner import CpuGraphRunner
from helpers import build_tiny_model, hf_greedy

PROMPTS = [[5, 6, 7], list(range(100, 130)), [9] * 4]


def _run(folder, prompts, **flags):
    llm = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks_override=64, **flags)
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
        return ([o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs],
                llm.engine.executor.runner.graph_runner.num_replays)
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("cpu_graph") / "llama", "llama")


def test_compiled_decode_steps_give_the_eager_tokens_and_logprobs(folder):
    """Batches of 3 and of 1, contexts crossing 4-slot blocks (fresh blocks zeroed inside the graph),
    against eager and against transformers."""
    eager_tokens, eager_lps, eager_replays = _run(folder, PROMPTS)
    tokens, lps, replays = _run(folder, PROMPTS, enable_graph=True)
    assert eager_replays == 0 and replays >= 11  # every decode step after the prefills, plus the warm-up
    assert tokens == eager_tokens == hf_greedy(folder, PROMPTS, 12)
    assert lps == pytest.approx(eager_lps, abs=1e-4)
    single, _, _ = _run(folder, PROMPTS[1:2], enable_graph=True)
    assert single == eager_tokens[1:2]


def test_max_tokens_for_graph_mode_caps_the_compiled_batch(folder):
    """Decode batches of 3 over the cap of 2 run eagerly (same tokens); only the warm-up steps replay."""
    eager_tokens, _, _ = _run(folder, PROMPTS)
    tokens, _, replays = _run(folder, PROMPTS, enable_graph=True, max_tokens_for_graph_mode=2)
    assert tokens == eager_tokens
    assert replays == 2  # the two warm-up steps (batches of 1 and 2); every live decode batch held 3


def test_the_runner_is_eager_without_enable_graph_and_for_foreign_metadata():
    runner = CpuGraphRunner()
    runner.capture(lambda **kw: None, [])
    assert runner.compiled is None and not runner.can_replay(1, True)
    runner.capture(lambda input_ids, positions: input_ids + positions, [1, 2, 4])
    ids, pos = torch.arange(3), torch.arange(3)
    assert runner.run(lambda input_ids, positions: input_ids * 0, input_ids=ids, positions=pos).tolist() == [0, 0, 0]
    assert runner.num_replays == 0  # no attention metadata naming its dynamic dimensions: eager


def test_cpu_accepts_graph_flags_but_not_the_device_only_padding_switch():
    from heterollm.config.support import check_support

    cfg = load_config([], overrides={"model": "x", "enable_graph": True, "max_tokens_for_graph_mode": 8}).config
    assert check_support(cfg, "cpu") == []
    cfg = load_config([], overrides={"model": "x", "enable_graph_mode_decode_no_padding": True}).config
    assert check_support(cfg, "cpu") == [
        "--enable_graph_mode_decode_no_padding=true: device graphs only: the CPU graph (torch.compile) has dynamic "
        "shapes and never pads a batch (selected platform: cpu)"]


def test_graph_with_tensor_parallel_is_refused_on_cpu():
    cfg = load_config([], overrides={"model": "x", "enable_graph": True, "tp_size": 2}).config
    assert "--enable_graph with --tp_size > 1 is not supported on CPU" in CpuGraphRunner.validate(cfg)[0]
    assert CpuGraphRunner.validate(load_config([], overrides={"model": "x", "enable_graph": True}).config) == []
