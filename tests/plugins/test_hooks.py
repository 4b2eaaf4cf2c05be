"""General plugins through pluggy."""
from __future__ import annotations

from heterollm.plugins import Registry, make_plugin_manager


def test_plugin_hooks_called(fake_dists):
    fake_dists("fakeplug-hooks", "1.0", {"heterollm.plugins": {"hooks": "fakeplug_hooks"}},
               {"fakeplug_hooks/__init__.py": """
                    __heterollm_api__ = ">=1.0"
                    from heterollm.plugins import hookimpl

                    @hookimpl
                    def heterollm_register_models(register):
                        register("FakeForCausalLM", "fakeplug_hooks:Fake")

                    @hookimpl
                    def heterollm_on_request(request_id, prompt_token_ids, sampling):
                        return "too long" if len(prompt_token_ids) > 3 else None
                """})
    pm = make_plugin_manager(Registry.discover())
    seen = []
    pm.hook.heterollm_register_models(register=lambda arch, target: seen.append((arch, target)))
    assert seen == [("FakeForCausalLM", "fakeplug_hooks:Fake")]
    assert pm.hook.heterollm_on_request(request_id="r", prompt_token_ids=[1, 2, 3, 4], sampling=None) == ["too long"]


def test_plugin_with_bad_hook_is_skipped(fake_dists):
    fake_dists("fakeplug-badhook", "1.0", {"heterollm.plugins": {"badhook": "fakeplug_badhook"}},
               {"fakeplug_badhook/__init__.py": """
                    __heterollm_api__ = ">=1.0"
                    from heterollm.plugins import hookimpl

                    @hookimpl
                    def heterollm_register_models(register, extra_arg_not_in_spec):
                        pass
                """})
    reg = Registry.discover()
    pm = make_plugin_manager(reg)
    [entry] = reg.candidates("plugins", "badhook")
    assert entry.error and "rejected" in entry.error
    assert pm.hook.heterollm_register_models(register=lambda *a: None) == []
