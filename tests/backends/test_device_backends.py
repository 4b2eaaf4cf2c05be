"""The CUDA, NPU and MLU backends on a machine without their devices: installed, reported unusable
with the reason, refused at launch by name; and everything device-independent checked on CPU (the
graph-capturable paged attention, the device-graph bookkeeping with ops that re-run the captured
function, batch-size buckets, platform-owned flags). Checks that need a GPU skip without one."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from helpers import build_tiny_model
from heterollm import LLM, SamplingParams
from heterollm.config import load_config
from heterollm.model_executor.graph_capture import DeviceGraphRunner
from heterollm.model_executor.layers import ForwardContext
from heterollm.model_executor.paged_attention import TorchPagedAttention
from heterollm.model_executor.runner import graph_batch_sizes
from heterollm.testing.conformance import check_paged_attention
from heterollm.testing.graphs import RerunGraphOps

CUDA = torch.cuda.is_available()


def test_backends_are_installed_and_say_why_they_are_unusable(cli):
    r = cli("backends")
    assert r.rc == 0
    for name, why in [("cuda", "is built without CUDA" if torch.version.cuda is None else "no CUDA device"),
                      ("npu", "torch_npu is not installed"), ("mlu", "torch_mlu is not installed")]:
        if name == "cuda" and CUDA:
            continue
        line = next(i for i, l in enumerate(r.out.splitlines()) if l.strip().startswith(name + " "))
        assert why in r.out.splitlines()[line + 1], r.out


@pytest.mark.parametrize("device,why", [("npu", "torch_npu is not installed"), ("mlu", "torch_mlu is not installed")])
def test_launch_on_a_missing_device_names_it(cli, device, why):
    r = cli("generate", "--model", "smollm2", "--prompt", "x", "--device", device)
    assert r.rc == 2 and f"--device={device}" in r.err and why in r.err and "Traceback" not in r.err


def test_the_device_graph_padding_flag_is_refused_on_cpu(cli):
    r = cli("generate", "--model", "smollm2", "--prompt", "x", "--enable_graph_mode_decode_no_padding")
    assert r.rc == 2 and "--enable_graph_mode_decode_no_padding=true: device graphs only" in r.err


def test_npu_refuses_the_npu_flags_it_does_not_build():
    from heterollm_npu.platform import NpuPlatform

    cfg = load_config([], overrides={"model": "x", "enable_fused_mc2": 1, "npu_kernel_backend": "TORCH"}).config
    problems = NpuPlatform().validate(cfg)
    assert problems == ["--enable_fused_mc2=1: owned by the npu platform but not implemented by heterollm-npu yet"]


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_graph_capturable_attention_matches_the_reference_on_cpu(block_size):
    check_paged_attention(TorchPagedAttention(), torch.device("cpu"), block_size, steps=12)


def test_batch_size_buckets():
    def sizes(**flags):
        return graph_batch_sizes(load_config([], overrides={"model": "x", **flags}).config)
    assert sizes() == []
    assert sizes(enable_graph=True, max_seqs_per_batch=20) == [1, 2, 4, 8, 16, 20]
    assert sizes(enable_graph=True, max_tokens_for_graph_mode=6) == [1, 2, 4, 6]
    assert sizes(enable_graph=True, enable_graph_mode_decode_no_padding=True, max_seqs_per_batch=5) == [1, 2, 3, 4, 5]


class Runner(DeviceGraphRunner):
    platforms = ("cpu",)

    def make_ops(self):
        return RerunGraphOps()


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    llm = LLM(str(folder), dtype="float32", num_gpu_blocks_override=32, block_size=4)
    yield llm.engine.executor.runner.model
    llm.shutdown()


def steps(model, runner, lengths, decodes, bs=4):
    """Prefill sequences of `lengths`, then `decodes` decode steps; returns every step's output and
    the caches (one extra scratch block last)."""
    backend = TorchPagedAttention()
    layers, kv, d = model.kv_geometry
    per_seq = 40 // bs
    caches = [torch.full(backend.kv_cache_shape(per_seq * len(lengths), bs, kv, d), float("nan"))
              for _ in range(layers)]
    tables = [list(range(per_seq * i, per_seq * (i + 1))) for i in range(len(lengths))]
    ctx_lens = [0] * len(lengths)
    outs = []
    gen = torch.Generator().manual_seed(0)
    from heterollm.interfaces import AttentionInputs
    for step in range(decodes + 1):
        q_lens = lengths if step == 0 else [1] * len(lengths)
        used = [-(-(c + q) // bs) for c, q in zip(ctx_lens, q_lens)]
        meta = backend.build_metadata(AttentionInputs(q_lens, ctx_lens, [t[:u] for t, u in zip(tables, used)], bs),
                                      torch.device("cpu"))
        ids = torch.randint(3, 500, (sum(q_lens),), generator=gen)
        pos = torch.cat([torch.arange(c, c + q) for c, q in zip(ctx_lens, q_lens)])
        with torch.inference_mode():
            out = runner.run(lambda input_ids, positions, ctx: model(input_ids, positions, ctx), input_ids=ids,
                             positions=pos, ctx=ForwardContext(backend, meta, caches))
        outs.append(out.clone())
        ctx_lens = [c + q for c, q in zip(ctx_lens, q_lens)]
    return outs, caches


@pytest.mark.parametrize("bs,captures", [(4, 1), (1, 2)])  # block size 1: tables outgrow the first width
def test_replayed_decodes_equal_eager_and_padding_stays_in_the_scratch_block(model, bs, captures):
    eager = Runner()
    eager.capture(None, [])
    graphed = Runner()
    graphed.capture(None, [1, 2, 4, 8])
    lengths = [5, 9, 2]  # a decode batch of 3 replays bucket 4 with one padded row
    want, want_caches = steps(model, eager, lengths, decodes=12, bs=bs)
    got, got_caches = steps(model, graphed, lengths, decodes=12, bs=bs)
    assert graphed.num_replays == 12 and eager.num_replays == 0
    assert graphed.ops.captures == captures
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    real = 3 * (40 // bs)
    for a, b in zip(want_caches, got_caches):  # real blocks identical (NaN where never written)
        torch.testing.assert_close(b[:, :real], a[:, :real], equal_nan=True)
        assert not torch.isnan(b[:, real, 0]).all()  # the padded row wrote into the scratch block


def test_prefill_steps_and_oversized_batches_run_eagerly():
    runner = Runner()
    runner.capture(None, [1, 2, 4])
    assert runner.can_replay(4, True) and not runner.can_replay(5, True) and not runner.can_replay(2, False)
    assert dataclasses.is_dataclass(ForwardContext)


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
    from heterollm_cuda.platform import CudaPlatform

    cfg = load_config([], overrides={"model": "x", "enable_custom_all_reduce": True, "enable_graph": True}).config
    assert CudaPlatform().validate(cfg) == [
        "--enable_custom_all_reduce=True: owned by the cuda platform but not implemented by heterollm-cuda yet"]


GRAPH_FAMILY = '''
from heterollm.model_executor.graph_capture import DeviceGraphRunner
from heterollm.model_executor.paged_attention import TorchPagedAttention
from heterollm.testing.graphs import RerunGraphOps


class Attention(TorchPagedAttention):
    platforms = ("cpu",)


class Runner(DeviceGraphRunner):
    platforms = ("cpu",)

    def make_ops(self):
        return RerunGraphOps()

    def capture(self, forward, batch_sizes):  # capture these sizes without --enable_graph
        super().capture(forward, batch_sizes or [1, 2, 4, 8])
'''


def test_device_path_through_the_engine_gives_the_reference_tokens(tmp_path, fake_dists):
    """The device backends' attention and graph runner, registered as a family for the CPU, run by
    the real engine and model runner: the same greedy tokens as the CPU reference, decode steps
    replayed from (re-run) graphs with padded buckets."""
    from heterollm.plugins import get_registry

    fake_dists("fakeplug-graphs", "1.0", {"heterollm.attention": {"graphs": "fakeplug_graphs.family:Attention"},
                                          "heterollm.graph_runners": {"graphs": "fakeplug_graphs.family:Runner"}},
               {"fakeplug_graphs/__init__.py": '__heterollm_api__ = ">=1.0,<2"\n',
                "fakeplug_graphs/family.py": GRAPH_FAMILY})
    get_registry(refresh=True)
    try:
        folder = build_tiny_model(tmp_path / "llama", "llama")
        p = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
        prompts = [[5, 6, 7], list(range(100, 130)), [9] * 4]  # decode batches of 3: bucket 4, one padded row
        runs = {}
        for impl in ("", "graphs"):
            llm = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks_override=64, extension_impl=impl)
            outs = llm.generate(prompts, p)
            runs[impl] = ([o.outputs[0].token_ids for o in outs],
                          [lp.logprob for o in outs for lp in o.outputs[0].logprobs])
            if impl:
                assert llm.engine.executor.runner.graph_runner.num_replays >= 10
            llm.shutdown()
        assert runs["graphs"][0] == runs[""][0]
        assert runs["graphs"][1] == pytest.approx(runs[""][1], abs=1e-4)
    finally:  # rediscovered lazily by the next user, once the fake distribution is gone
        import heterollm.plugins.registry as registry
        registry._REGISTRY = None
