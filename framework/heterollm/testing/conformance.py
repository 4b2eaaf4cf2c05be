"""The backend conformance kit: the contract checks every heterollm backend must pass, run against
any installed platform and component family.

    pytest -p heterollm.testing.conformance --pyargs heterollm.testing.conformance \\
        --heterollm-device cpu [--heterollm-impl FAMILY]

Checks (each names the component it exercises):
  - registration: the platform and every component resolve for the device, declare a contract
    range the core implements, and `validate` a default config without complaint;
  - attention: paged attention over mixed batches (prefill, chunked prefill over cached context,
    decode) on shuffled block tables, against a dense reference, for several block sizes;
  - communicator: all_reduce, all_gather, broadcast and barrier on 2 ranks (spawned processes);
  - graph runner: `run` gives the eager result for every batch size, captured or not;
  - executor: greedy tokens and logprobs of a tiny random llama on the backend equal the CPU
    reference's (and transformers', when the backend is the reference itself).
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
        cls = selection.component(group)
        assert config.device.device in cls.platforms, f"{group}: {cls.__name__} does not name the platform"
        assert cls.validate(config) == [], f"{group}: {cls.__name__} refuses a default config"
    assert selection.platform.validate(config) == []
    free, total = selection.platform.memory_info()
    assert 0 <= free <= total, "memory_info is (free, total) bytes"
    assert API_VERSION  # the registry checked the backend's __heterollm_api__ against it


# -- attention -------------------------------------------------------------------------------------
H, KV, D = 6, 2, 8


def dense_reference(q, k, v, ctx, scale):
    """q (n, H, D) at positions ctx..ctx+n-1 over one sequence's k/v (ctx+n, KV, D), in float64."""
    q, k, v = q.double(), k.double().repeat_interleave(H // KV, 1), v.double().repeat_interleave(H // KV, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    causal = torch.arange(k.shape[0])[None, :] <= torch.arange(ctx, ctx + q.shape[0])[:, None]
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~causal, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_paged_attention_matches_dense_reference(target, block_size):
    _, selection = target
    check_paged_attention(selection.component("attention")(), torch.device(selection.platform.device_type),
                          block_size)


def check_paged_attention(backend, device: torch.device, block_size: int, steps: int = 10) -> None:
    """Mixed steps (prefill, chunked prefill over cached context, decode; decode-only steps too) on
    shuffled block tables of a NaN-filled cache, each output against the dense reference."""
    from heterollm.interfaces import AttentionInputs

    rng, gen = random.Random(block_size), torch.Generator().manual_seed(block_size)
    num_blocks = 160
    cache = torch.full(backend.kv_cache_shape(num_blocks, block_size, KV, D), float("nan"), device=device)
    free = list(range(num_blocks))
    rng.shuffle(free)
    seqs = [dict(plen=p, chunk=c, k=torch.zeros(0, KV, D), v=torch.zeros(0, KV, D), table=[])
            for p, c in [(5, 5), (17, 4), (1, 1), (33, 16), (2, 2)]]  # prefill (in chunks), then decode
    scale = D ** -0.5
    for _ in range(steps):
        q_lens, ctx_lens = [], []
        for s in seqs:
            ctx = s["k"].shape[0]
            n = min(s["chunk"], s["plen"] - ctx) if ctx < s["plen"] else 1
            while len(s["table"]) * block_size < ctx + n:
                s["table"].append(free.pop())
            q_lens.append(n)
            ctx_lens.append(ctx)
        meta = backend.build_metadata(AttentionInputs(q_lens, ctx_lens, [list(s["table"]) for s in seqs], block_size),
                                      device)
        total = sum(q_lens)
        q, k, v = (torch.randn(total, h, D, generator=gen) for h in (H, KV, KV))
        out = backend.forward(q.to(device), k.to(device), v.to(device), cache, meta, scale).cpu()
        assert out.shape == (total, H, D)
        start = 0
        for s, n, ctx in zip(seqs, q_lens, ctx_lens):
            s["k"], s["v"] = torch.cat([s["k"], k[start:start + n]]), torch.cat([s["v"], v[start:start + n]])
            want = dense_reference(q[start:start + n], s["k"], s["v"], ctx, scale).float()
            torch.testing.assert_close(out[start:start + n], want, atol=1e-4, rtol=1e-4)
            start += n


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


# -- graph runner ----------------------------------------------------------------------------------
def test_graph_runner_replay_equals_eager(target):
    _, selection = target
    device = torch.device(selection.platform.device_type)
    runner = selection.component("graph_runners")()
    weight = torch.randn(16, 16, generator=torch.Generator().manual_seed(0)).to(device)

    def forward(input_ids, positions):
        return torch.tanh(torch.nn.functional.embedding(input_ids % 16, weight) * (positions[:, None] + 1))

    sizes = [1, 2, 4, 8]
    runner.capture(forward, sizes)
    for n in [1, 2, 3, 4, 8, 13]:
        ids = torch.arange(n, device=device) * 3
        pos = torch.arange(n, device=device) + 5
        assert isinstance(runner.can_replay(n, True), bool)
        torch.testing.assert_close(runner.run(forward, input_ids=ids, positions=pos), forward(ids, pos))


# -- executor ----------------------------------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9], list(range(100, 140)), [42, 43, 44]]


def _generate(folder: Path, device: str, impl: str) -> tuple[list[list[int]], list[float]]:
    from heterollm import LLM, SamplingParams

    llm = LLM(str(folder), device=device, extension_impl=impl, dtype="float32", block_size=4,
              num_gpu_blocks_override=96, max_model_len=128, max_tokens_per_chunk_for_prefill=16)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=1))
    finally:
        llm.shutdown()
    return [o.outputs[0].token_ids for o in outs], [lp.logprob for o in outs for lp in o.outputs[0].logprobs]


def _transformers_greedy(folder: Path) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    for p in PROMPTS:
        ids = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False, min_new_tokens=10,
                             pad_token_id=0)[0]
        outs.append(ids[len(p):].tolist())
    return outs


def test_executor_matches_the_cpu_reference(target, tiny_model):
    config, _ = target
    tokens, logprobs = _generate(tiny_model, config.device.device, config.execution.extension_impl)
    if config.device.device == "cpu" and config.execution.extension_impl in ("", "cpu"):
        assert tokens == _transformers_greedy(tiny_model)
        return
    ref_tokens, ref_logprobs = _generate(tiny_model, "cpu", "")
    assert tokens == ref_tokens
    assert logprobs == pytest.approx(ref_logprobs, abs=1e-3)


if __name__ == "__main__":  # python -m heterollm.testing.conformance --heterollm-device NAME
    import sys

    raise SystemExit(pytest.main(["-p", "heterollm.testing.conformance", "--pyargs", "heterollm.testing.conformance",
                                  *sys.argv[1:]]))
