"""General plugins through pluggy: the core itself calls the request hooks of an installed plugin
(found through its `heterollm.plugins` entry point) on a real engine run."""
from __future__ import annotations

import pytest

from helpers import build_tiny_model
from heterollm import LLM, SamplingParams
import heterollm.plugins.registry as plugin_registry
from heterollm.plugins import Registry, make_plugin_manager

PLUGIN = """
    __heterollm_api__ = ">=1.0"
    from heterollm.plugins import hookimpl

    admitted = []   # (request_id, prompt_token_ids, max_tokens) per heterollm_on_request call
    finished = []   # (request_id, [(finish_reason, token_ids) per choice]) per heterollm_on_request_finished call

    @hookimpl
    def heterollm_on_request(request_id, prompt_token_ids, sampling):
        admitted.append((request_id, list(prompt_token_ids), sampling.max_tokens))
        return "prompts over 6 tokens are not allowed here" if len(prompt_token_ids) > 6 else None

    @hookimpl
    def heterollm_on_request_finished(request_id, output):
        finished.append((request_id, [(c.finish_reason, list(c.token_ids)) for c in output.outputs]))
"""

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture
def plugin(fake_dists):
    """The installed plugin module (its `admitted` / `finished` lists), seen by engines built now."""
    fake_dists("fakeplug-hooks", "1.0", {"heterollm.plugins": {"hooks": "fakeplug_hooks"}},
               {"fakeplug_hooks/__init__.py": PLUGIN})
    plugin_registry.get_registry(refresh=True)
    import fakeplug_hooks
    yield fakeplug_hooks
    plugin_registry._REGISTRY = None  # the next user rediscovers, without this test's distribution


def make_llm(tiny) -> LLM:
    return LLM(str(tiny), dtype="float32", block_size=8, num_gpu_blocks_override=64, max_model_len=128)


def test_engine_calls_both_hooks_once_per_request(tiny, plugin):
    llm = make_llm(tiny)
    try:
        outs = llm.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_tokens=4, n=2, **GREEDY))
    finally:
        llm.shutdown()
    ids = [o.request_id for o in outs]
    assert plugin.admitted == [(ids[0], [5, 6, 7], 4), (ids[1], [8, 9, 10, 11], 4)], "once per request, not per choice"
    expected = {o.request_id: [("length", c.token_ids) for c in o.outputs] for o in outs}
    assert sorted(plugin.finished) == sorted(expected.items())
    assert all(len(tokens) == 4 for o in outs for _, tokens in expected[o.request_id])


def test_a_plugin_refuses_a_request_before_anything_runs(tiny, plugin):
    llm = make_llm(tiny)
    engine = llm.engine
    try:
        with pytest.raises(ValueError, match="prompts over 6 tokens are not allowed here"):
            llm.generate([list(range(5, 15))], SamplingParams(max_tokens=4, n=3, **GREEDY))
        assert not engine.has_unfinished() and engine.kv.num_free_blocks == engine.num_blocks
        assert not engine.scheduler.requests, "no choice of a refused request stays admitted"
        assert plugin.finished == [], "a refused request was never admitted, so it never finishes"
        [ok] = llm.generate([[5, 6]], SamplingParams(max_tokens=2, **GREEDY))
        assert len(ok.outputs[0].token_ids) == 2
    finally:
        llm.shutdown()


def test_an_aborted_request_finishes_once_with_abort(tiny, plugin):
    llm = make_llm(tiny)
    engine = llm.engine
    try:
        rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=50, **GREEDY))
        engine.step()
        engine.step()
        engine.abort(rid)
        engine.abort(rid)  # a second abort of a gone request is a no-op, not a second call
        [(finished_id, choices)] = plugin.finished
        assert finished_id == rid and [reason for reason, _ in choices] == ["abort"]
        assert 1 <= len(choices[0][1]) < 50
    finally:
        llm.shutdown()


def test_a_refusal_is_http_400_with_the_reason(tiny, plugin):
    from fastapi.testclient import TestClient

    from heterollm.config import load_config
    from heterollm.engine.llm_engine import LLMEngine
    from heterollm.entrypoints.openai.server import OpenAIServer, ServerSettings

    config = load_config([], overrides={"model": str(tiny), "dtype": "float32", "block_size": 8,
                                        "num_gpu_blocks_override": 64, "max_model_len": 128}).config
    server = OpenAIServer(LLMEngine(config), ServerSettings(served_model_names=["m"]))
    with TestClient(server.app) as client:
        r = client.post("/v1/completions", json={"prompt": list(range(5, 15)), "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "prompts over 6 tokens are not allowed here" in r.json()["error"]["message"]
        ok = client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200, ok.text
    assert [rid for rid, _ in plugin.finished] == [rid for rid, ids, _ in plugin.admitted if len(ids) <= 6]


def test_plugin_with_bad_hook_is_skipped(fake_dists):
    fake_dists("fakeplug-badhook", "1.0", {"heterollm.plugins": {"badhook": "fakeplug_badhook"}},
               {"fakeplug_badhook/__init__.py": """
                    __heterollm_api__ = ">=1.0"
                    from heterollm.plugins import hookimpl

                    @hookimpl
                    def heterollm_on_request(request_id, prompt_token_ids, sampling, extra_arg_not_in_spec):
                        return "never"
                """})
    reg = Registry.discover()
    pm = make_plugin_manager(reg)
    [entry] = reg.candidates("plugins", "badhook")
    assert entry.error and "rejected" in entry.error
    assert pm.hook.heterollm_on_request(request_id="r", prompt_token_ids=[1], sampling=None) == []


def test_every_hookspec_is_called_by_the_core():
    """A hookspec nobody calls is a broken promise to plugin authors: each name must appear in a
    core module other than the one declaring it."""
    from pathlib import Path

    import heterollm
    from heterollm.plugins.hooks import HeterollmHookSpec

    specs = [n for n in vars(HeterollmHookSpec) if n.startswith("heterollm_")]
    root = Path(heterollm.__file__).parent
    sources = "\n".join(p.read_text() for p in root.rglob("*.py") if p.name != "hooks.py")
    assert specs and all(f"hook.{name}(" in sources for name in specs), specs
