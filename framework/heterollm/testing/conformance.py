"""The backend conformance kit: the contract checks every heterollm backend must pass, run against
any installed platform and component family.

    pytest -p heterollm.testing.conformance --pyargs heterollm.testing.conformance \\
        --heterollm-device cpu [--heterollm-impl FAMILY]

Checks (each names the component it exercises):
  - registration: the platform and every component resolve for the device, declare a contract
    range the core implements, and `validate` a default config without complaint;
  - attention: paged attention over mixed batches (prefill, chunked prefill over cached context,
    decode) on shuffled block tables of a NaN-filled cache, against a float64 dense reference, for
    several block sizes, and with a sliding window and capped scores where the backend supports
    them, and MLA's latent attention (`forward_mla`) where it implements it; the metadata's
    declared fields (what graph runners read) match the step;
    a scratch block, if the layout has one, is no sequence's block; where the backend
    `supports_kv_cache_dtype("int8")`, the same steps on a quantized cache whose every byte starts
    as 0xFF (NaN scales), within the quantization's tolerance;
  - dtypes: every dtype the platform says it supports (`supports_dtype`) runs that attention
    within the dtype's tolerance, and `--dtype auto` never picks one it does not support;
  - sampler: temperature / top-k / top-p / min-p / penalties / seeded draws on logits of the
    device build every tensor on that device (heterollm.testing.devices; on a CPU-hosted platform,
    with the logits presented as living on another device);
  - communicator: all_reduce, all_gather, broadcast and barrier on 2 ranks (spawned processes), and
    all_to_all with uneven splits where it implements it (expert parallelism needs it);
  - graph runner: captured at start-up from decode-only steps of the selected attention backend,
    `run` gives the eager result for every batch size, and every step it says it can replay is
    replayed (a runner that replays nothing is reported as skipped, never as passed);
  - executor: a tiny random llama on the backend gives the CPU reference's greedy tokens and
    logprobs (transformers' when the backend is the reference itself), with `--enable_graph` too;
    seeded sampling repeats itself, and on a CPU-hosted platform gives the reference's tokens
    (a device's generator draws other numbers from the same seed).
A platform that is installed but not available here (no device) skips every check with its reason.
"""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

DEVICE_OPTION, IMPL_OPTION = "--heterollm-device", "--heterollm-impl"


def pytest_addoption(parser) -> None:
    group = parser.getgroup("heterollm conformance")
    group.addoption(DEVICE_OPTION, default="cpu", help="the platform (--device) to check; default cpu")
    group.addoption(IMPL_OPTION, default="", help="the component family (--extension_impl); default: the "
                                                  "platform's own")


# -- fixtures ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def target(request):
    """(config, selection) for the device and family under test; skips when the device is absent."""
    from heterollm.config import load_config
    from heterollm.plugins import get_registry, resolve

    device = request.config.getoption(DEVICE_OPTION, "cpu")
    impl = request.config.getoption(IMPL_OPTION, "")
    entry = get_registry().get("platforms", device)
    if entry is not None and entry.ok and not entry.obj().is_available():
        pytest.skip(f"platform {device!r} is installed but not available here: {entry.obj().unavailable_reason()}")
    config = load_config([], overrides={"model": "conformance", "device": device, "extension_impl": impl}).config
    return config, resolve(config)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("conformance-llama"))


def build_tiny_llama(folder: Path) -> Path:
    """A 2-layer llama with random weights and a 512-word tokenizer, built offline."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(512)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")
    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    model.save_pretrained(folder, safe_serialization=True)
    fast.save_pretrained(folder)
    return folder


# -- registration ----------------------------------------------------------------------------------
def test_registration_and_contract_range(target):
    from heterollm.interfaces import API_VERSION
    from heterollm.plugins.registry import COMPONENT_GROUPS

    config, selection = target
    assert selection.platform.name == config.device.device
    assert set(COMPONENT_GROUPS) <= set(selection.components), "every component group resolves"
    for group in COMPONENT_GROUPS:
        cls, entry = selection.component(group), selection.components[group]
        assert config.device.device in entry.runs_on, f"{group}: {entry.backend} does not run {cls.__name__} here"
        assert cls.validate(config) == [], f"{group}: {cls.__name__} refuses a default config"
    assert selection.platform.validate(config) == []
    free, total = selection.platform.memory_info()
    assert 0 <= free <= total, "memory_info is (free, total) bytes"
    assert API_VERSION  # the registry checked the backend descriptor's api_version against it


# -- attention -------------------------------------------------------------------------------------
H, KV, D = 6, 2, 8


def dense_reference(q, k, v, ctx, scale, window=None, softcap=None):
    """q (n, H, D) at positions ctx..ctx+n-1 over one sequence's k/v (ctx+n, KV, D), in float64; with
    `window`, each query sees only its last `window` keys (itself included); with `softcap` c, scores
    are c * tanh(scores / c)."""
    q, k, v = q.double(), k.double().repeat_interleave(H // KV, 1), v.double().repeat_interleave(H // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    keys, queries = torch.arange(k.shape[0])[None, :], torch.arange(ctx, ctx + q.shape[0])[:, None]
    causal = (keys <= queries) & (keys > queries - window) if window else keys <= queries
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense_reference(target, block_size):
    _, selection = target
    check_paged_attention(selection.component("attention")(), torch.device(selection.platform.device_type),
                          block_size)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_attention_int8_kv_cache_matches_dense_reference(target, dtype):
    _, selection = target
    backend = selection.component("attention")
    if not backend.supports_kv_cache_dtype("int8"):
        pytest.skip(f"{backend.__name__} does not store an int8 KV cache (a launch refuses --kv_cache_dtype=int8)")
    check_paged_attention(backend(), torch.device(selection.platform.device_type), 4, dtype=dtype,
                          kv_cache_dtype="int8")


@pytest.mark.parametrize("window", [1, 6])
def test_paged_attention_sliding_window_matches_dense_reference(target, window):
    _, selection = target
    backend = selection.component("attention")
    if not backend.supports_sliding_window():
        pytest.skip(f"{backend.__name__} does not honour a sliding window (a launch refuses such models)")
    check_paged_attention(backend(), torch.device(selection.platform.device_type), 4, sliding_window=window)


@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_logit_softcap_matches_dense_reference(target, window):
    _, selection = target
    backend = selection.component("attention")
    if not backend.supports_logit_softcap() or (window and not backend.supports_sliding_window()):
        pytest.skip(f"{backend.__name__} does not cap attention scores (a launch refuses such models)")
    check_paged_attention(backend(), torch.device(selection.platform.device_type), 4, sliding_window=window,
                          logit_softcap=0.5)


TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
QUANTIZED_TOLERANCE = {"int8": 5e-2}
"""--kv_cache_dtype: per-token, per-head int8 K/V err by up to max|x| / 254 per value."""


def check_metadata(meta, inputs) -> None:
    """The declared fields a graph runner reads and copies into its static buffers say what the
    step's inputs say (the padding of block_tables past each sequence's blocks is the backend's)."""
    bs, seq_lens = inputs.block_size, [c + q for c, q in zip(inputs.context_lens, inputs.query_lens)]
    slots = [t[p // bs] * bs + p % bs for t, c, n in zip(inputs.block_tables, inputs.context_lens, seq_lens)
             for p in range(c, n)]
    assert meta.block_size == bs and meta.num_tokens == sum(inputs.query_lens)
    assert (meta.num_prefill_tokens, meta.num_decode_tokens) == (inputs.num_prefill_tokens, inputs.num_decode_tokens)
    assert meta.decode_only == (inputs.num_prefill_tokens == 0)
    assert meta.slot_mapping.cpu().tolist() == slots and meta.seq_lens.cpu().tolist() == seq_lens
    assert meta.query_start_loc.cpu().tolist() == [sum(inputs.query_lens[:i]) for i in range(len(seq_lens) + 1)]
    tables = meta.block_tables.cpu().tolist()
    assert all(row[:len(t)] == t for row, t in zip(tables, inputs.block_tables)) and len(tables) == len(seq_lens)
    if meta.decode_only:  # what a compiling graph runner marks dynamic
        assert all(isinstance(t, torch.Tensor) and isinstance(d, int) for t, d in meta.dynamic_dims())


def check_scratch_block(backend, num_blocks: int = 12, block_size: int = 4) -> None:
    """A scratch block, where the layout has one, is not one of the sequences' blocks."""
    cache = torch.empty(backend.kv_cache_shape(num_blocks, block_size, KV, D), device="meta")
    scratch = backend.scratch_block(cache)
    assert scratch is None or (isinstance(scratch, int) and scratch >= num_blocks), f"scratch block {scratch}"


def test_attention_scratch_block_is_no_sequences_block(target):
    _, selection = target
    check_scratch_block(selection.component("attention")())


def _mixed_steps(backend, device: torch.device, block_size: int, steps: int):
    """The kit's mixed steps: five sequences on shuffled blocks of a 160-block cache (prefill in chunks,
    then decode; decode-only steps too). Yields (query lens, context lens, checked metadata)."""
    from heterollm.interfaces import AttentionInputs

    rng = random.Random(block_size)
    free = list(range(160))
    rng.shuffle(free)
    seqs = [dict(plen=p, chunk=c, ctx=0, table=[]) for p, c in [(5, 5), (17, 4), (1, 1), (33, 16), (2, 2)]]
    for _ in range(steps):
        q_lens, ctx_lens = [], []
        for s in seqs:
            ctx = s["ctx"]
            n = min(s["chunk"], s["plen"] - ctx) if ctx < s["plen"] else 1
            while len(s["table"]) * block_size < ctx + n:
                s["table"].append(free.pop())
            q_lens.append(n)
            ctx_lens.append(ctx)
            s["ctx"] = ctx + n
        inputs = AttentionInputs(q_lens, ctx_lens, [list(s["table"]) for s in seqs], block_size)
        meta = backend.build_metadata(inputs, device)
        check_metadata(meta, inputs)
        yield q_lens, ctx_lens, meta


def check_paged_attention(backend, device: torch.device, block_size: int, steps: int = 10,
                          dtype: torch.dtype = torch.float32, sliding_window: int | None = None,
                          logit_softcap: float | None = None, head_dim: int = D,
                          kv_cache_dtype: str = "auto") -> None:
    """Mixed steps (prefill, chunked prefill over cached context, decode; decode-only steps too) on
    shuffled block tables of a NaN-filled cache of `dtype`, each output against the dense reference.
    `head_dim`: the kit's small default keeps it fast; a backend whose kernels take only model-sized
    heads (64, 128) runs it at those too. `kv_cache_dtype` other than "auto": the backend's quantized
    cache instead, every byte 0xFF (a float scale of those bytes is NaN), at QUANTIZED_TOLERANCE."""
    gen = torch.Generator().manual_seed(block_size)
    if kv_cache_dtype == "auto":
        cache = torch.full(backend.kv_cache_shape(160, block_size, KV, head_dim), float("nan"), device=device,
                           dtype=dtype)
        tol = TOLERANCE[dtype]
    else:
        cache = torch.full(backend.quantized_kv_cache_shape(160, block_size, KV, head_dim, kv_cache_dtype), -1,
                           device=device, dtype=getattr(torch, kv_cache_dtype))
        tol = max(TOLERANCE[dtype], QUANTIZED_TOLERANCE[kv_cache_dtype])
    ks, vs = [torch.zeros(0, KV, head_dim)] * 5, [torch.zeros(0, KV, head_dim)] * 5
    scale = head_dim ** -0.5
    for q_lens, ctx_lens, meta in _mixed_steps(backend, device, block_size, steps):
        total = sum(q_lens)
        q, k, v = (torch.randn(total, h, head_dim, generator=gen).to(dtype) for h in (H, KV, KV))
        extra = {name: value for name, value in (("sliding_window", sliding_window), ("logit_softcap", logit_softcap))
                 if value is not None}
        out = backend.forward(q.to(device), k.to(device), v.to(device), cache, meta, scale, **extra).cpu()
        assert out.shape == (total, H, head_dim) and out.dtype == dtype
        start = 0
        for i, (n, ctx) in enumerate(zip(q_lens, ctx_lens)):
            ks[i], vs[i] = torch.cat([ks[i], k[start:start + n]]), torch.cat([vs[i], v[start:start + n]])
            want = dense_reference(q[start:start + n], ks[i], vs[i], ctx, scale, sliding_window,
                                   logit_softcap).float()
            torch.testing.assert_close(out[start:start + n].float(), want, atol=tol, rtol=tol)
            start += n


MLA_LATENT, MLA_VALUE = 24, 16
"""The kit's latent (compressed KV + shared rotary key) and value sizes for MLA."""


def mla_reference(q, latents, ctx, scale, value_dim):
    """q (n, H, L) at positions ctx..ctx+n-1 over one sequence's latents (ctx+n, L), in float64: every
    head attends to the latents and reads their first `value_dim` features."""
    q, k = q.double(), latents.double()
    scores = torch.einsum("qhd,kd->hqk", q, k) * scale
    causal = torch.arange(k.shape[0])[None, :] <= torch.arange(ctx, ctx + q.shape[0])[:, None]
    return torch.einsum("hqk,kd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), k[:, :value_dim])


def check_mla_attention(backend, device: torch.device, block_size: int, steps: int = 10,
                        dtype: torch.dtype = torch.float32) -> None:
    """`forward_mla` over the kit's mixed steps on a NaN-filled latent cache, against the float64
    reference."""
    gen = torch.Generator().manual_seed(block_size)
    cache = torch.full(backend.mla_cache_shape(160, block_size, MLA_LATENT), float("nan"), device=device, dtype=dtype)
    latents = [torch.zeros(0, MLA_LATENT)] * 5
    scale = 0.3
    for q_lens, ctx_lens, meta in _mixed_steps(backend, device, block_size, steps):
        total = sum(q_lens)
        q = torch.randn(total, H, MLA_LATENT, generator=gen).to(dtype)
        latent = torch.randn(total, MLA_LATENT, generator=gen).to(dtype)
        out = backend.forward_mla(q.to(device), latent.to(device), cache, meta, scale, MLA_VALUE).cpu()
        assert out.shape == (total, H, MLA_VALUE) and out.dtype == dtype
        start = 0
        for i, (n, ctx) in enumerate(zip(q_lens, ctx_lens)):
            latents[i] = torch.cat([latents[i], latent[start:start + n]])
            want = mla_reference(q[start:start + n], latents[i], ctx, scale, MLA_VALUE).float()
            tol = TOLERANCE[dtype]
            torch.testing.assert_close(out[start:start + n].float(), want, atol=tol, rtol=tol)
            start += n


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_mla_attention_matches_dense_reference(target, block_size):
    _, selection = target
    backend = selection.component("attention")
    if not backend.supports_mla():
        pytest.skip(f"{backend.__name__} does not implement MLA attention (a launch refuses such models)")
    check_mla_attention(backend(), torch.device(selection.platform.device_type), block_size)


# -- dtypes ----------------------------------------------------------------------------------------
DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@pytest.mark.parametrize("name", sorted(DTYPE_NAMES))
def test_supported_dtypes_run_and_auto_avoids_the_others(target, name):
    from transformers import LlamaConfig

    from heterollm.model_executor.runner import resolve_dtype

    _, selection = target
    platform = selection.platform
    supported = platform.supports_dtype(name)
    assert isinstance(supported, bool)
    assert supported == platform.supports_dtype(name), "supports_dtype answers the same twice"
    chosen = resolve_dtype("auto", LlamaConfig(dtype=name), platform, is_gguf=False)
    assert platform.supports_dtype(str(chosen).removeprefix("torch.")), f"--dtype auto picked {chosen}"
    if not supported:
        pytest.skip(f"platform {platform.name!r} says {name} is not supported")
    check_paged_attention(selection.component("attention")(), torch.device(platform.device_type), block_size=4,
                          steps=6, dtype=DTYPE_NAMES[name])


# -- sampler -----------------------------------------------------------------------------------------
def sampling_rows(device: torch.device):
    """A greedy row, and seeded rows exercising temperature, top-k, top-p, min-p and penalties."""
    from heterollm import SamplingParams
    from heterollm.sampling.sampler import SamplingRow

    def row(seed: int | None, **params) -> SamplingRow:
        gen = torch.Generator(device=device).manual_seed(seed) if seed is not None else None
        return SamplingRow(SamplingParams(max_tokens=4, logprobs=2, **params), gen, [3, 4, 5], [6, 6])

    return [row(None, temperature=0),
            row(1, temperature=0.8, top_k=5),
            row(2, temperature=1.1, top_p=0.9, min_p=0.05),
            row(3, temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)]


def test_sampler_keeps_every_tensor_on_the_logits_device(target):
    """A sampler that builds a parameter tensor on the CPU works on a CPU and crashes on the first
    sampled request on an accelerator; here it fails on any machine."""
    from heterollm.sampling.sampler import Sampler
    from heterollm.testing.devices import DeviceMixingDetector

    _, selection = target
    device = torch.device(selection.platform.device_type)
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    hosted = device.type == "cpu"  # no second device here: present the logits as living on another
    detector = DeviceMixingDetector() if hosted else DeviceMixingDetector(fake=None)
    with detector as dev:
        tokens, logprobs = Sampler()(dev.place(logits) if hosted else logits.to(device),
                                     sampling_rows(torch.device("cpu") if hosted else device))
    assert "aten.exponential_.default" in dev.ops, "the seeded rows were drawn"
    assert len(tokens) == 4 and all(0 <= t < 64 for t in tokens)
    assert tokens[0] == int(logits[0].argmax()) and all(lp is not None for lp in logprobs)


# -- communicator ----------------------------------------------------------------------------------
def _collectives(rank: int, world: int, address: str, device: str, impl: str, results) -> None:
    from heterollm.config import load_config
    from heterollm.plugins import resolve

    try:
        config = load_config([], overrides={"model": "conformance", "device": device, "extension_impl": impl}).config
        selection = resolve(config)
        selection.platform.set_device(rank)
        dev = torch.device(selection.platform.device_type)
        comm = selection.component("communicators")(rank, world, address)
        got = {"rank": comm.rank, "world": comm.world_size}
        got["all_reduce"] = comm.all_reduce(torch.full((3,), float(rank + 1), device=dev)).cpu().tolist()
        got["all_gather"] = comm.all_gather(torch.full((2, 1), float(rank), device=dev), dim=1).cpu().tolist()
        got["broadcast"] = comm.broadcast(torch.full((2,), float(rank * 10 + 7), device=dev), src=1).cpu().tolist()
        if comm.supports_all_to_all():  # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 sends 3, 0
            send = [1, 2] if rank == 0 else [3, 0]
            rows = torch.arange(3 * 2, dtype=torch.float32).view(3, 2) + 100 * rank
            out, counts = comm.all_to_all(rows.to(dev), send)
            got["all_to_all"] = (out.cpu().tolist(), counts)
        comm.barrier()
        comm.destroy()
        results.put(got)
    except Exception as exc:  # reported to the test, which names the rank
        results.put({"rank": rank, "error": repr(exc)})


def test_communicator_collectives_on_two_ranks(target):
    import multiprocessing as mp

    from heterollm.distributed.executor import free_port

    config, selection = target
    if selection.platform.device_count() < 2 and selection.platform.device_type != "cpu":
        pytest.skip(f"platform {selection.platform.name!r} has fewer than 2 devices here")
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    address = f"tcp://127.0.0.1:{free_port()}"
    procs = [ctx.Process(target=_collectives, args=(r, 2, address, config.device.device,
                                                     config.execution.extension_impl, results)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    got = sorted((results.get() for _ in range(2)), key=lambda g: g["rank"])
    for g in got:
        assert "error" not in g, f"rank {g['rank']}: {g.get('error')}"
        assert g["world"] == 2
        assert g["all_reduce"] == [3.0, 3.0, 3.0]
        assert g["all_gather"] == [[0.0, 1.0], [0.0, 1.0]]
        assert g["broadcast"] == [17.0, 17.0]
    if "all_to_all" not in got[0]:
        pytest.skip(f"{selection.component('communicators').__name__} does not implement all_to_all (expert "
                    f"parallelism is refused with it); the other collectives passed")
    assert got[0]["all_to_all"] == ([[0.0, 1.0], [100.0, 101.0], [102.0, 103.0], [104.0, 105.0]], [1, 3])
    assert got[1]["all_to_all"] == ([[2.0, 3.0], [4.0, 5.0]], [2, 0])


# -- graph runner ----------------------------------------------------------------------------------
GRAPH_SIZES, GRAPH_WIDTH = [1, 2, 4, 8], 8
GRAPH_BATCHES = [1, 3, 8, 13]
"""Decode batch sizes checked: exactly a bucket, padded into one, the largest, larger than any."""


class ToyModel:
    """One attention layer between an embedding and the output: a forward that reads every field a
    graph runner must keep in its static buffers (ids, positions, the attention metadata)."""

    def __init__(self, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        self.embed = torch.randn(64, 32, generator=gen).to(device)
        self.qkv = (torch.randn(32, (H + 2 * KV) * D, generator=gen) * 0.2).to(device)

    def __call__(self, inputs):
        x = torch.nn.functional.embedding(inputs.input_ids % 64, self.embed) * (inputs.positions[:, None] + 1) ** 0.5
        q, k, v = (x @ self.qkv).split([H * D, KV * D, KV * D], dim=-1)
        ctx = inputs.ctx
        out = ctx.backend.forward(q.reshape(-1, H, D), k.reshape(-1, KV, D), v.reshape(-1, KV, D), ctx.kv_caches[0],
                                  ctx.metadata, D ** -0.5)
        return out.flatten(1)


def step_inputs(backend, caches, device, query_lens, context_lens, tables, block_size: int, gen=None):
    from heterollm.interfaces import AttentionInputs, ForwardContext, StepInputs

    meta = backend.build_metadata(AttentionInputs(query_lens, context_lens, tables, block_size), device)
    n = sum(query_lens)
    ids = torch.randint(0, 64, (n,), generator=gen) if gen is not None else torch.zeros(n, dtype=torch.long)
    pos = torch.cat([torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)])
    return StepInputs(ids.to(device), pos.to(device), ForwardContext(backend, meta, caches))


def used(tables: list[list[int]], seq_lens: list[int], block_size: int) -> list[list[int]]:
    """Each table cut to the blocks its sequence's length occupies (the engine allocates no more)."""
    return [t[:-(-n // block_size)] for t, n in zip(tables, seq_lens)]


def test_graph_runner_replays_decode_steps_with_the_eager_result(target):
    _, selection = target
    device = torch.device(selection.platform.device_type)
    if not check_graph_runner(selection.component("attention")(), selection.component("graph_runners")(), device):
        pytest.skip("the graph runner replays no decode step (an eager graph runner)")


def check_graph_runner(backend, runner, device: torch.device, block_size: int = 4) -> bool:
    """Capture at start-up from decode-only steps of `backend`; then, for batches of several sizes
    (some padded into a bucket, one larger than every bucket), a prefill and three decode steps:
    each output equals the eager forward over the same cache, and every step the runner says it
    can replay is counted as replayed. False when the runner replays nothing at all."""
    model, bs = ToyModel(device), block_size
    caches = [torch.full(backend.kv_cache_shape(1 + sum(GRAPH_BATCHES) * GRAPH_WIDTH, bs, KV, D), float("nan"),
                         device=device)]

    def make_inputs(n: int):  # what the model runner hands over: n decodes at position 1 of block 0
        return step_inputs(backend, caches, device, [1] * n, [1] * n, [[0] * GRAPH_WIDTH] * n, bs)

    with torch.inference_mode():
        runner.capture(model, GRAPH_SIZES, make_inputs)
        if not any(runner.can_replay(n, True) for n in GRAPH_SIZES):
            return False
        replays, expected, gen, next_block = runner.num_replays, 0, torch.Generator().manual_seed(1), 1
        for n in GRAPH_BATCHES:
            tables = [list(range(next_block + i * GRAPH_WIDTH, next_block + (i + 1) * GRAPH_WIDTH)) for i in range(n)]
            next_block += n * GRAPH_WIDTH
            lens = [5 + 2 * i for i in range(n)]
            runner.run(model, step_inputs(backend, caches, device, lens, [0] * n, used(tables, lens, bs), bs, gen))
            for t in range(3):
                ctx = [c + t for c in lens]
                inputs = step_inputs(backend, caches, device, [1] * n, ctx, used(tables, [c + 1 for c in ctx], bs), bs,
                                     gen)
                assert inputs.ctx.metadata.decode_only
                expected += runner.can_replay(n, True)
                got = runner.run(model, inputs).clone()
                torch.testing.assert_close(got, model(inputs), atol=1e-4, rtol=1e-4)  # rewrites the same K/V
    assert runner.num_replays - replays == expected > 0, "every replayable decode step replayed"
    return True


# -- executor ----------------------------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42, 43, 44]]
GREEDY = dict(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1)
SAMPLED = dict(max_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=1234, ignore_eos=True)


def _generate(folder: Path, device: str, impl: str, **flags) -> dict:
    """Greedy tokens and logprobs, seeded-sampled tokens, and the graph replays of one engine."""
    from heterollm import LLM, SamplingParams

    llm = LLM(str(folder), device=device, extension_impl=impl, dtype="float32", block_size=4,
              num_gpu_blocks_override=96, max_model_len=128, max_tokens_per_chunk_for_prefill=16, **flags)
    try:
        prompts = [{"prompt_token_ids": p} for p in PROMPTS]
        greedy = llm.generate(prompts, SamplingParams(**GREEDY))
        sampled = llm.generate(prompts, SamplingParams(**SAMPLED))
        runner = getattr(getattr(llm.engine.executor, "runner", None), "graph_runner", None)
    finally:
        llm.shutdown()
    return {"folder": str(folder), "tokens": [o.outputs[0].token_ids for o in greedy],
            "logprobs": [lp.logprob for o in greedy for lp in o.outputs[0].logprobs],
            "sampled": [o.outputs[0].token_ids for o in sampled],
            "replays": None if runner is None else runner.num_replays,
            "replayable": runner is not None and runner.can_replay(1, True)}


def _transformers_greedy(folder: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                             pad_token_id=0)[0]
        outs.append(ids[len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def reference(tiny_model) -> dict:
    """The CPU reference engine's results."""
    return _generate(tiny_model, "cpu", "")


@pytest.fixture(scope="module")
def on_target(target, tiny_model) -> dict:
    config, _ = target
    return _generate(tiny_model, config.device.device, config.execution.extension_impl)


def _is_reference(config) -> bool:
    return config.device.device == "cpu" and config.execution.extension_impl in ("", "cpu")


def test_executor_greedy_matches_the_cpu_reference(target, tiny_model, reference, on_target):
    config, _ = target
    if _is_reference(config):
        assert on_target["tokens"] == _transformers_greedy(tiny_model)
        return
    assert on_target["tokens"] == reference["tokens"]
    assert on_target["logprobs"] == pytest.approx(reference["logprobs"], abs=1e-3)


def test_executor_seeded_sampling_repeats_and_matches_a_cpu_hosted_reference(target, tiny_model, reference,
                                                                            on_target):
    config, selection = target
    assert on_target["sampled"] != on_target["tokens"], "temperature 0.9 should leave the greedy path"
    if selection.platform.device_type == "cpu":  # the same generator as the reference's
        assert on_target["sampled"] == reference["sampled"]
    else:  # a device generator draws other numbers from the same seed: the same engine must repeat itself
        again = _generate(tiny_model, config.device.device, config.execution.extension_impl)
        assert on_target["sampled"] == again["sampled"]


def test_executor_with_graphs_gives_the_eager_results(target, on_target):
    """--enable_graph changes no token: greedy and seeded-sampled tokens and logprobs equal the
    same backend's eager ones; a runner that can replay did replay."""
    from heterollm.config import ConfigError
    from heterollm.plugins import LaunchError

    config, _ = target
    try:
        got = _generate(Path(on_target["folder"]), config.device.device, config.execution.extension_impl,
                        enable_graph=True)
    except (ConfigError, LaunchError) as exc:
        pytest.skip(f"--enable_graph is refused by this backend: {exc}")
    assert got["tokens"] == on_target["tokens"] and got["sampled"] == on_target["sampled"]
    assert got["logprobs"] == pytest.approx(on_target["logprobs"], abs=1e-4)
    if got["replayable"]:
        assert got["replays"] > 0, "--enable_graph: decode steps replayed a graph"


if __name__ == "__main__":  # python -m heterollm.testing.conformance --heterollm-device NAME
    import sys

    raise SystemExit(pytest.main(["-p", "heterollm.testing.conformance", "--pyargs", "heterollm.testing.conformance",
                                  *sys.argv[1:]]))
