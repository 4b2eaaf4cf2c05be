"""The CPU graph runner (`--enable_graph` on CPU): decode-only steps run through torch.compile and
give the eager engine's tokens and logprobs."""
from __future__ import annotations

import logging

import pytest
import torch

from heterollm import LLM, SamplingParams
from heterollm.config import load_config
from heterollm.interfaces import AttentionInputs, ForwardContext, StepInputs
from heterollm.model_executor.paged_attention import TorchPagedAttention
from heterollm_cpu.attention import CpuPagedAttention
from heterollm_cpu.graph_runner import MODEL_GUARDS_SKIPPED, CpuGraphRunner, inductor_options, model_guard_filter
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


def test_compiled_decode_steps_give_the_eager_tokens_and_logprobs(folder, monkeypatch):
    """Batches of 3 and of 1, contexts crossing 4-slot blocks (fresh blocks zeroed inside the graph),
    against eager and against transformers; the compiled step traces without a graph break, with the
    C++ decode kernel looked up for the first time in this engine (as in a fresh process)."""
    from torch._dynamo.utils import counters

    from heterollm_cpu import kernels

    eager_tokens, eager_lps, eager_replays = _run(folder, PROMPTS)
    monkeypatch.setattr(kernels, "_loaded", None)
    counters.clear()
    tokens, lps, replays = _run(folder, PROMPTS, enable_graph=True)
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert eager_replays == 0 and replays >= 11  # every decode step after the prefills, plus the start-up ones
    assert tokens == eager_tokens == hf_greedy(folder, PROMPTS, 12)
    assert lps == pytest.approx(eager_lps, abs=1e-4)
    single, _, _ = _run(folder, PROMPTS[1:2], enable_graph=True)
    assert single == eager_tokens[1:2]


def test_max_tokens_for_graph_mode_caps_the_compiled_batch(folder):
    """Decode batches of 3 over the cap of 2 run eagerly (same tokens); only the start-up steps replay."""
    eager_tokens, _, _ = _run(folder, PROMPTS)
    tokens, _, replays = _run(folder, PROMPTS, enable_graph=True, max_tokens_for_graph_mode=2)
    assert tokens == eager_tokens
    assert replays == 2  # the two start-up steps (batches of 2 and 1); every live decode batch held 3


def decode_inputs(backend):
    """Decode steps of n sequences over a one-layer cache, as the model runner's start-up builds."""
    cache = [torch.zeros(backend.kv_cache_shape(4, 4, 1, 8))]

    def make(n: int) -> StepInputs:
        meta = backend.build_metadata(AttentionInputs([1] * n, [1] * n, [[0]] * n, 4), torch.device("cpu"))
        return StepInputs(torch.arange(n), torch.ones(n, dtype=torch.long), ForwardContext(backend, meta, cache))
    return make


def test_the_runner_is_eager_without_enable_graph_and_for_metadata_without_dynamic_dims():
    runner = CpuGraphRunner()
    forward = lambda inputs: inputs.input_ids * 0  # noqa: E731
    runner.capture(forward, [], decode_inputs(CpuPagedAttention()))
    assert runner.compiled is None and not runner.can_replay(1, True)
    make = decode_inputs(TorchPagedAttention())  # its metadata names no dynamic dimensions
    runner.capture(forward, [1, 2, 4], make)
    assert runner.compiled is None and runner.run(forward, make(3)).tolist() == [0, 0, 0]
    assert runner.num_replays == 0


def test_a_compiled_step_that_fails_mid_serving_falls_back_to_eager(caplog):
    def broken(inputs):
        raise RuntimeError("inductor could not compile this shape")

    runner = CpuGraphRunner()
    runner.compiled, runner.max_batch = broken, 4
    make = decode_inputs(CpuPagedAttention())
    with caplog.at_level(logging.WARNING, logger="heterollm.cpu.graph"):
        assert runner.run(lambda inputs: inputs.input_ids + 1, make(2)).tolist() == [1, 2]
    assert "compiled decode step failed (RuntimeError: inductor could not compile this shape)" in caplog.text
    assert runner.compiled is None and not runner.can_replay(1, True) and runner.num_replays == 0


def test_cpu_accepts_graph_flags_but_not_the_device_only_padding_switch():
    from heterollm.plugins import LaunchError, resolve

    resolve(load_config([], overrides={"model": "x", "enable_graph": True, "max_tokens_for_graph_mode": 8}).config)
    with pytest.raises(LaunchError) as refused:
        resolve(load_config([], overrides={"model": "x", "enable_graph_mode_decode_no_padding": True}).config)
    assert refused.value.reasons == [
        "--enable_graph_mode_decode_no_padding=true: device graphs only: the CPU graph (torch.compile) has dynamic "
        "shapes and never pads a batch (heterollm-cpu, selected)"]


def test_graph_with_tensor_parallel_is_refused_on_cpu():
    cfg = load_config([], overrides={"model": "x", "enable_graph": True, "tp_size": 2}).config
    assert "--enable_graph with --tp_size > 1 is not supported on CPU" in CpuGraphRunner.validate(cfg)[0]
    assert CpuGraphRunner.validate(load_config([], overrides={"model": "x", "enable_graph": True}).config) == []


def test_later_batch_sizes_reuse_the_start_up_graphs(folder):
    """The one graph compiled at start-up (at a batch of 2, sizes as symbols) serves every later decode
    step: batches of 5, 4, 3, 2, 1 and contexts crossing blocks compile nothing more (a compile while
    serving stalls every request for seconds; a second graph for a batch of one cost 35 of the
    84 s SmolLM2's cold start took)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()  # an earlier test's engine left a compiled step whose guards this one passes
    before = counters["frames"]["total"]
    llm = LLM(str(folder), dtype="float32", block_size=4, num_gpu_blocks_override=64, enable_graph=True)
    try:
        compiled = counters["frames"]["total"]
        assert compiled - before == 1
        replays = llm.engine.executor.runner.graph_runner.num_replays
        llm.generate(PROMPTS + [[1, 2], [3] * 9], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        assert llm.engine.executor.runner.graph_runner.num_replays - replays >= 11
        assert counters["frames"]["total"] == compiled
    finally:
        llm.shutdown()


def test_inductor_skips_its_vector_isa_probe_only_where_the_kernels_are_built(monkeypatch):
    """Built kernels (g++ -march=native for this CPU's flags) stand for inductor's per-ISA test
    programs; without them inductor probes as usual."""
    from heterollm_cpu import kernels

    monkeypatch.setattr(kernels, "_loaded", True)
    assert inductor_options() == {"size_asserts": False, "cpp.vec_isa_ok": True}
    monkeypatch.setattr(kernels, "_loaded", False)
    assert inductor_options() == {"size_asserts": False}


def test_the_trusted_vector_isas_are_the_ones_inductor_probes():
    """What inductor targets when told to trust /proc/cpuinfo (`cpp.vec_isa_ok`) is what its own
    build-and-load probe finds on this machine: the same ISAs, the same bf16 support."""
    from torch._inductor import config
    from torch._inductor import cpu_vec_isa as isa

    def picked(ok):
        isa.valid_vec_isa_list.cache_clear()
        with config.patch({"cpp.vec_isa_ok": ok}):
            found = isa.valid_vec_isa_list()
            return [(str(v), v.build_arch_flags()) for v in found], str(isa.pick_vec_isa())

    try:
        trusted, probed = picked(True), picked(None)
    finally:
        isa.valid_vec_isa_list.cache_clear()
    assert trusted == probed and trusted[0]


def test_the_guard_filter_skips_only_the_models_structure_and_weight_metadata():
    from types import SimpleNamespace as Entry

    def kept(guard_type, name, is_global=False):
        return model_guard_filter([Entry(guard_type=guard_type, name=name, is_global=is_global)])[0]

    weight = "self.model._modules['model']._modules['norm']._parameters['weight']"
    for guard_type in MODEL_GUARDS_SKIPPED:
        assert not kept(guard_type, weight)
        assert kept(guard_type, "inputs.ctx.kv_caches[0]")  # the step's inputs: every guard kept
        assert kept(guard_type, "self.model", is_global=True)
    assert kept("TYPE_MATCH", "self")  # the runner itself
    for guard_type in ("CONSTANT_MATCH", "EQUALS_MATCH", "DUPLICATE_INPUT", "ID_MATCH"):  # the model's values
        assert kept(guard_type, "self.model._modules['model'].num_layers")


def test_compiled_steps_take_reloaded_weights(tmp_path):
    """--dynamic_load_weight under --enable_graph: the compiled step (which skips the guards on the
    weights' metadata) multiplies with model B's weights after the reload, as transformers running B
    does, and compiles nothing again."""
    from torch._dynamo.utils import counters

    a, b = build_tiny_model(tmp_path / "a", "llama", seed=0), build_tiny_model(tmp_path / "b", "llama", seed=1)
    prompt, greedy = list(range(300, 324)), SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    llm = LLM(str(a), dtype="float32", block_size=4, num_gpu_blocks_override=64, enable_graph=True,
              dynamic_load_weight=1, enable_prefix_cache=False)
    try:
        runner = llm.engine.executor.runner
        assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == hf_greedy(a, [prompt], 10)[0]
        replays, frames = runner.graph_runner.num_replays, counters["stats"]["unique_graphs"]
        llm.update_weights(path=str(b))
        assert llm.generate([prompt], greedy)[0].outputs[0].token_ids == hf_greedy(b, [prompt], 10)[0]
        assert runner.graph_runner.num_replays >= replays + 9
        assert counters["stats"]["unique_graphs"] == frames
    finally:
        llm.shutdown()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_decoder_layers_share_one_compiled_region_each(family, tmp_path, monkeypatch):
    """The compiled step holds one graph of the layer before its attention and one after it, which
    every layer runs with its own weights (the packed weights reach the graph as inputs, not as
    constants): compiled once, not once per layer. The tokens are still the eager ones."""
    from torch._inductor.compile_fx import compile_fx

    graphs, patches = [], {}

    def recording(gm, example_inputs):
        graphs.append(gm)
        return compile_fx(gm, example_inputs, config_patches=patches)

    def compile_recording(fn, options=None, **kw):  # the runner's inductor options go to compile_fx
        options = dict(options or {})
        guard_filter = options.pop("guard_filter_fn")  # torch.compile's own, not inductor's
        patches.update(options)
        return compile(fn, backend=recording, options={"guard_filter_fn": guard_filter}, **kw)

    folder = build_tiny_model(tmp_path / family, family)
    eager_tokens, _, _ = _run(folder, PROMPTS)
    compile = torch.compile
    monkeypatch.setattr(torch, "compile", compile_recording)
    tokens, _, replays = _run(folder, PROMPTS, enable_graph=True)
    assert replays >= 11 and tokens == eager_tokens
    assert patches == inductor_options() and patches["size_asserts"] is False
    (gm,) = graphs
    regions = [name for name, _ in gm.named_children() if name.startswith("subgraph")]
    calls = [node for node in gm.graph.nodes if node.target is torch.ops.higher_order.invoke_subgraph]
    assert len(regions) == 2 and len(calls) == 2 * 2  # begin and finish; two layers


@pytest.mark.parametrize("quantization", [None, "bf16-dot", "wint8", "wint4", "wint4-vnni", "w8a8"])
def test_every_kernel_a_step_calls_has_a_fake_that_matches_the_real_op(folder, quantization, monkeypatch):
    """The compiled step runs without inductor's size asserts (graph_runner.py), so the C++ kernels'
    fakes must give the real outputs' shapes, dtypes and strides: every heterollm_cpu call of a prefill
    and decode steps, recorded with its real arguments, goes through torch.library.opcheck."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.namespace == "heterollm_cpu":
                calls.append((func, torch.utils._pytree.tree_map_only(torch.Tensor, torch.clone, (args, kwargs))))
            return func(*args, **kwargs)

    if quantization == "wint4-vnni":  # int4_dot_linear on any CPU (its scalar loop without VNNI)
        import heterollm_cpu.linear as cpu_linear

        vnni = cpu_linear._cpu_flags() | {"avx512f", "avx512_vnni"}
        monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: vnni)
        quantization = "wint4"
    dtype = "float32"
    if quantization == "bf16-dot":  # bf16 weights on bf16_linear on any CPU (its scalar loop without AVX512_BF16)
        import heterollm_cpu.linear as cpu_linear

        bf16 = cpu_linear._cpu_flags() | {"avx512f", "avx512_bf16"}
        monkeypatch.setattr(cpu_linear, "_cpu_flags", lambda: bf16)
        quantization, dtype = None, "bfloat16"
    flags = {"quantization": quantization} if quantization else {}
    llm = LLM(str(folder), dtype=dtype, block_size=4, num_gpu_blocks_override=64, **flags)
    try:
        with Record():
            llm.generate(PROMPTS[:2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finally:
        llm.shutdown()
    seen = {}
    for func, (args, kwargs) in calls:
        seen.setdefault(func, (args, kwargs))
    names = {str(func) for func in seen}
    assert {"heterollm_cpu.paged_decode.default", "heterollm_cpu.rms_norm.default"} <= names, names
    if quantization in ("wint8", "w8a8"):
        assert names & {"heterollm_cpu.int8_gemm.default", "heterollm_cpu.w8a8_linear.default",
                        "heterollm_cpu.int8_dot_gemm.default"}, names
    if dtype == "bfloat16":
        assert "heterollm_cpu.bf16_linear.default" in names, names
    if quantization == "wint4":
        from heterollm_cpu.linear import WeightOnlyInt4

        op = "int4_dot_linear" if WeightOnlyInt4().dot else "int4_linear"
        assert f"heterollm_cpu.{op}.default" in names, names
    for func, (args, kwargs) in seen.items():
        torch.library.opcheck(func, args, kwargs, test_utils=("test_schema", "test_faketensor"))
