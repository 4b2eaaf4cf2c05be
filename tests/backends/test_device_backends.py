"""The CUDA, NPU and MLU backends on a machine without their devices: installed, reported unusable
with the reason, refused at launch by name; and everything device-independent checked on CPU (the
graph-capturable paged attention, the device-graph bookkeeping with ops that re-run the captured
function, batch-size buckets, platform-owned flags). Checks that need a GPU skip without one."""
from __future__ import annotations

import logging

import pytest
import torch

from helpers import build_tiny_model
from heterollm import LLM, SamplingParams
from heterollm.config import load_config
from heterollm.interfaces import AttentionInputs, ForwardContext, StepInputs
from heterollm.model_executor.graph_capture import DeviceGraphRunner
from heterollm.model_executor.paged_attention import TorchPagedAttention
from heterollm.model_executor.runner import graph_batch_sizes
from heterollm.testing.conformance import check_graph_runner, check_paged_attention
from heterollm.testing.graphs import CaptureFailed, RerunGraphOps

CUDA = torch.cuda.is_available()


def test_backends_are_installed_and_say_why_they_are_unusable(cli):
    r = cli("backends")
    assert r.rc == 0
    for name, why in [("cuda", "is built without CUDA" if torch.version.cuda is None else "no CUDA device"),
                      ("npu", "torch_npu is not installed"), ("mlu", "torch_mlu is not installed")]:
        if name == "cuda" and CUDA:
            continue
        lines = r.out.splitlines()
        line = next(i for i in range(lines.index("platforms:"), len(lines)) if lines[i].strip().startswith(name + " "))
        assert why in lines[line + 1], r.out


@pytest.mark.parametrize("device,why", [("npu", "torch_npu is not installed"), ("mlu", "torch_mlu is not installed")])
def test_launch_on_a_missing_device_names_it(cli, device, why):
    r = cli("generate", "--model", "smollm2", "--prompt", "x", "--device", device)
    assert r.rc == 2 and f"--device={device}" in r.err and why in r.err and "Traceback" not in r.err


def test_the_device_graph_padding_flag_is_refused_on_cpu(cli):
    r = cli("generate", "--model", "smollm2", "--prompt", "x", "--enable_graph_mode_decode_no_padding")
    assert r.rc == 2 and "--enable_graph_mode_decode_no_padding=true: device graphs only" in r.err


def test_npu_refuses_the_npu_flags_it_does_not_build():
    from heterollm.plugins import get_registry
    from heterollm.plugins.resolver import unsupported_flags

    cfg = load_config([], overrides={"model": "x", "enable_fused_mc2": 1, "npu_kernel_backend": "TORCH"}).config
    assert unsupported_flags(cfg, get_registry(), ["npu"]) == [
        "--enable_fused_mc2=1: owned by heterollm-npu but not implemented yet (heterollm-npu, selected)"]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_graph_capturable_attention_matches_the_reference_on_cpu(block_size):
    check_paged_attention(TorchPagedAttention(), torch.device("cpu"), block_size, steps=12)


@pytest.mark.parametrize("window", [1, 6])
def test_graph_capturable_attention_honours_a_sliding_window_on_cpu(window):
    """NPU and MLU run this attention: a sliding-window model (Mistral, Gemma 3) launches there."""
    check_paged_attention(TorchPagedAttention(), torch.device("cpu"), 4, steps=12, sliding_window=window)


def test_batch_size_buckets():
    def sizes(**flags):
        return graph_batch_sizes(load_config([], overrides={"model": "x", **flags}).config)
    assert sizes() == []
    assert sizes(enable_graph=True, max_seqs_per_batch=20) == [1, 2, 4, 8, 16, 20]
    assert sizes(enable_graph=True, max_tokens_for_graph_mode=6) == [1, 2, 4, 6]
    assert sizes(enable_graph=True, enable_graph_mode_decode_no_padding=True, max_seqs_per_batch=5) == [1, 2, 3, 4, 5]


class Runner(DeviceGraphRunner):
    def __init__(self, fail_at: int | None = None) -> None:
        super().__init__(RerunGraphOps(fail_at))


class FlatTorchAttention(TorchPagedAttention):
    """The same kernels on a layout without a scratch block (as a vendor's may be)."""

    def scratch_block(self, kv_cache):
        return None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=32, block_size=4)
    yield llm.engine.executor.runner.model
    llm.shutdown()


def forward_of(model):
    return lambda inputs: model(inputs.input_ids, inputs.positions, inputs.ctx)


def decode_inputs(backend, caches, bs: int, width: int):
    """The model runner's start-up decode step: n sequences at position 1 of block 0."""
    def make(n: int) -> StepInputs:
        meta = backend.build_metadata(AttentionInputs([1] * n, [1] * n, [[0] * width] * n, bs), torch.device("cpu"))
        return StepInputs(torch.zeros(n, dtype=torch.long), torch.ones(n, dtype=torch.long),
                          ForwardContext(backend, meta, caches))
    return make


def steps(model, runner, lengths, decodes, bs=4, sizes=(), backend=None):
    """Capture `sizes` at start-up, prefill sequences of `lengths`, then run `decodes` decode steps;
    returns every step's output and the caches (the backend's scratch block last)."""
    backend = backend or TorchPagedAttention()
    layers, kv, d = model.kv_geometry
    per_seq = 40 // bs
    caches = [torch.full(backend.kv_cache_shape(per_seq * len(lengths), bs, kv, d), float("nan"))
              for _ in range(layers)]
    with torch.inference_mode():
        runner.capture(forward_of(model), sizes, decode_inputs(backend, caches, bs, per_seq))
    tables = [list(range(per_seq * i, per_seq * (i + 1))) for i in range(len(lengths))]
    ctx_lens = [0] * len(lengths)
    outs = []
    gen = torch.Generator().manual_seed(0)
    for step in range(decodes + 1):
        q_lens = lengths if step == 0 else [1] * len(lengths)
        used = [-(-(c + q) // bs) for c, q in zip(ctx_lens, q_lens)]
        meta = backend.build_metadata(AttentionInputs(q_lens, ctx_lens, [t[:u] for t, u in zip(tables, used)], bs),
                                      torch.device("cpu"))
        ids = torch.randint(3, 500, (sum(q_lens),), generator=gen)
        pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)])
        with torch.inference_mode():
            out = runner.run(forward_of(model), StepInputs(ids, pos, ForwardContext(backend, meta, caches)))
        outs.append(out.clone())
        ctx_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    return outs, caches


@pytest.mark.parametrize("bs", [4, 1])
def test_replayed_decodes_equal_eager_and_padding_stays_in_the_scratch_block(model, bs):
    """Every bucket is captured once, at start-up, largest first; decodes (a batch of 3 replays
    bucket 4 with one padded row) then only replay, at any context length up to the width."""
    eager, graphed = Runner(), Runner()
    lengths = [5, 9, 2]
    want, want_caches = steps(model, eager, lengths, decodes=12, bs=bs)
    got, got_caches = steps(model, graphed, lengths, decodes=12, bs=bs, sizes=[1, 2, 4, 8])
    assert list(graphed.graphs) == [8, 4, 2, 1] and graphed.ops.captures == 4  # none while serving
    assert graphed.num_replays == 12 and eager.num_replays == 0 and eager.ops.captures == 0
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    real = 3 * (40 // bs)
    for a, b in zip(want_caches, got_caches):  # real blocks identical (NaN where never written)
        torch.testing.assert_close(b[:, :, :real], a[:, :, :real], equal_nan=True)
        assert not torch.isnan(b[:, :, real, 0]).any()  # the padded row wrote into the zeroed scratch block


def test_without_a_scratch_block_only_full_buckets_replay(model):
    runner = Runner()
    want, _ = steps(model, Runner(), [5, 9, 2, 4], decodes=3, backend=FlatTorchAttention())
    got, _ = steps(model, runner, [5, 9, 2, 4], decodes=3, sizes=[1, 2, 4], backend=FlatTorchAttention())
    assert runner.num_replays == 3  # batches of 4 fill bucket 4
    odd = Runner()
    steps(model, odd, [5, 9, 2], decodes=3, sizes=[1, 2, 4], backend=FlatTorchAttention())
    assert odd.num_replays == 0  # a batch of 3 would need a padded row: eager
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_a_failed_capture_leaves_the_runner_eager(model):
    runner = Runner(fail_at=2)
    with pytest.raises(CaptureFailed):
        steps(model, runner, [5, 9, 2], decodes=1, sizes=[1, 2, 4])
    assert runner.graphs == {} and runner.static is None and not runner.can_replay(1, True)
    steps(model, runner, [5, 9, 2], decodes=2)
    assert runner.num_replays == 0


def test_prefill_steps_and_oversized_batches_run_eagerly(model):
    runner = Runner()
    steps(model, runner, [3], decodes=0, sizes=[1, 2, 4])
    assert runner.can_replay(4, True) and not runner.can_replay(5, True) and not runner.can_replay(2, False)
    assert runner.num_replays == 0


@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_cuda_graph_replay_gives_the_eager_tokens(tmp_path):
    folder = build_tiny_model(tmp_path / "llama", "llama")
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    prompts = [[5, 6, 7], list(range(100, 130)), [9] * 4]
    outs = {}
    for graph in (False, True):
        llm = LLM(str(folder), device="cuda", dtype="float32", enable_graph=graph)
        outs[graph] = [o.outputs[0].token_ids for o in llm.generate(prompts, p)]
        if graph:
            assert llm.engine.executor.runner.graph_runner.num_replays > 0
        llm.shutdown()
    assert outs[True] == outs[False]


def test_cuda_refuses_the_cuda_flags_it_does_not_build_and_accepts_graphs():
    from heterollm.plugins import get_registry
    from heterollm.plugins.resolver import unsupported_flags
    from heterollm_cuda.platform import CudaPlatform

    cfg = load_config([], overrides={"model": "x", "enable_custom_all_reduce": True, "enable_graph": True}).config
    assert unsupported_flags(cfg, get_registry(), ["cuda"]) == [
        "--enable_custom_all_reduce=true: owned by heterollm-cuda but not implemented yet (heterollm-cuda, selected)"]
    assert CudaPlatform().validate(cfg) == []


def device_path_llm(folder, monkeypatch, runner: Runner) -> LLM:
    """An engine whose model runner uses the device backends' attention and graph runner (with
    re-running graph ops), swapped in before the cache is allocated and the graphs captured, as
    the executor's start-up does."""
    import heterollm.model_executor.runner as model_runner

    llm = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks_override=64)
    mr = llm.engine.executor.runner
    mr.attn_backend, mr.graph_runner = TorchPagedAttention(), runner
    monkeypatch.setattr(model_runner, "graph_batch_sizes", lambda config: [1, 2, 4, 8])
    mr.initialize_cache(64)
    return llm


def generate(llm):
    p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    outs = llm.generate([[5, 6, 7], list(range(100, 130)), [9] * 4], p)  # decode batches of 3: bucket 4, padded
    return [o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("device-path") / "llama", "llama")


@pytest.fixture(scope="module")
def reference(llama):
    llm = LLM(str(llama), dtype="float32", block_size=4, num_gpu_blocks_override=64)
    try:
        return generate(llm)
    finally:
        llm.shutdown()


def test_device_path_captures_at_start_up_and_gives_the_reference_tokens(llama, reference, monkeypatch):
    """The device backends' attention and graph runner, run by the real engine and model runner:
    every bucket captured at start-up, largest first, none while serving; the reference's greedy
    tokens and logprobs from replayed, padded decode steps."""
    runner = Runner()
    llm = device_path_llm(llama, monkeypatch, runner)
    try:
        assert list(runner.graphs) == [8, 4, 2, 1] and runner.ops.captures == 4
        tokens, logprobs = generate(llm)
    finally:
        llm.shutdown()
    assert runner.ops.captures == 4 and runner.num_replays >= 10
    assert tokens == reference[0]
    assert logprobs == pytest.approx(reference[1], abs=1e-4)


def test_a_failed_capture_at_start_up_serves_eagerly_with_a_warning(llama, reference, monkeypatch, caplog):
    runner = Runner(fail_at=2)
    with caplog.at_level(logging.WARNING, logger="heterollm.runner"):
        llm = device_path_llm(llama, monkeypatch, runner)
    try:
        assert "decode graph capture failed, running every step eagerly: CaptureFailed" in caplog.text
        assert runner.sizes == [] and runner.graphs == {}
        tokens, logprobs = generate(llm)
    finally:
        llm.shutdown()
    assert runner.num_replays == 0 and tokens == reference[0]
    assert logprobs == pytest.approx(reference[1], abs=1e-4)


@pytest.mark.parametrize("backend", [TorchPagedAttention(), FlatTorchAttention()], ids=["scratch", "no-scratch"])
def test_the_kits_graph_check_passes_the_device_graph_runner(backend):
    """The conformance kit's graph check (what a CUDA/NPU/MLU backend runs on its device), on the
    device graph bookkeeping with re-running graph ops."""
    runner = Runner()
    assert check_graph_runner(backend, runner, torch.device("cpu"))
    assert runner.ops.captures == 4 and runner.num_replays > 0


def test_graph_ops_hear_each_replays_live_host_arguments(model):
    """The GraphOps update hook (ACL graphs push host-side kernel arguments there) runs before
    every replay with the live step: its sequence lengths, not the padded bucket's."""
    class Recording(RerunGraphOps):
        def __init__(self):
            super().__init__()
            self.updates = []

        def update(self, graph, inputs):
            self.updates.append([c + q for c, q in zip(inputs.ctx.metadata.context_lens, inputs.ctx.metadata.query_lens)])

    runner = Runner()
    runner.ops = Recording()
    steps(model, runner, [5, 9, 2], decodes=2, sizes=[1, 2, 4])
    assert runner.num_replays == 2 and runner.ops.updates == [[6, 10, 3], [7, 11, 4]]
