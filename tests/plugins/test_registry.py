"""Discovery, extension_impl resolution and failure reporting of the plugin registry."""
from __future__ import annotations

import pytest

from heterollm.config import load_config
from heterollm.plugins import LaunchError, Registry, resolve

GOOD_ATTENTION = """
__heterollm_api__ = ">=1.0,<2"
"""
ATTN_MODULE = """
from heterollm_cpu.attention import CpuPagedAttention

class FakeAttention(CpuPagedAttention):
    platforms = ("cpu",)
"""


def cfg(*argv):
    return load_config(["--model", "m", *argv]).config


def test_installed_backends_discovered():
    reg = Registry.discover()
    cpu = reg.get("platforms", "cpu")
    assert cpu is not None and cpu.dist == "heterollm-cpu" and cpu.version
    for group in ("attention", "graph_runners", "communicators", "executors"):
        assert reg.get(group, "cpu").dist == "heterollm-cpu"
    example = reg.get("attention", "example")
    assert example is not None and example.dist == "heterollm-example-attention"
    assert reg.families() == sorted(set(reg.families())) and {"cpu", "example"} <= set(reg.families())


def test_default_family_resolution():
    sel = resolve(cfg(), Registry.discover())
    assert sel.platform.name == "cpu" and sel.platform.dist_backend == "gloo"
    assert {g: e.name for g, e in sel.components.items()} == {
        "attention": "cpu", "graph_runners": "cpu", "communicators": "cpu", "executors": "cpu"}
    assert sel.as_dict()["components"]["attention"]["origin"].startswith("heterollm-cpu")


def test_partial_family_falls_back_per_group():
    sel = resolve(cfg("--extension_impl=example"), Registry.discover())
    assert sel.components["attention"].name == "example"
    assert sel.components["attention"].dist == "heterollm-example-attention"
    assert sel.components["executors"].name == "cpu"
    assert sel.components["graph_runners"].name == "cpu"


def test_unknown_family_lists_installed():
    with pytest.raises(LaunchError) as info:
        resolve(cfg("--extension_impl=nosuch"), Registry.discover())
    msg = str(info.value)
    assert "--extension_impl=nosuch" in msg and "cpu" in msg and "example" in msg and "\n" not in msg


def test_missing_platform_lists_installed():
    with pytest.raises(LaunchError) as info:
        resolve(cfg("--device=xpu"), Registry.discover())
    assert "no platform 'xpu' is installed" in str(info.value) and "cpu (heterollm-cpu" in str(info.value)


def test_component_validate_reasons_collected():
    with pytest.raises(LaunchError) as info:
        resolve(cfg("--extension_impl=example", "--block_size=2048", "--enable_fused_mc2=1"), Registry.discover())
    assert len(info.value.reasons) >= 2
    assert any("attention example" in r for r in info.value.reasons)
    assert any("--enable_fused_mc2" in r for r in info.value.reasons)


def test_broken_plugin_reported_and_skipped(fake_dists):
    fake_dists("fakeplug-broken", "0.3", {"heterollm.attention": {"broken": "fakeplug_broken.attn:Attn"}},
               {"fakeplug_broken/__init__.py": GOOD_ATTENTION,
                "fakeplug_broken/attn.py": "raise RuntimeError('vendor SDK missing')\n"})
    reg = Registry.discover()
    [entry] = reg.candidates("attention", "broken")
    assert entry.error and "vendor SDK missing" in entry.error and entry.origin == "fakeplug-broken 0.3"
    assert entry in reg.failures()
    # the engine still resolves with the default family
    assert resolve(cfg(), reg).components["attention"].name == "cpu"
    # explicitly selecting it is an error that names it and the reason
    with pytest.raises(LaunchError, match="vendor SDK missing"):
        resolve(cfg("--extension_impl=broken"), reg)


def test_contract_violation_is_reported(fake_dists):
    fake_dists("fakeplug-wrong", "1.0", {"heterollm.attention": {"wrong": "fakeplug_wrong.attn:NotAnAttention",
                                                                 "half": "fakeplug_wrong.attn:Half"}},
               {"fakeplug_wrong/__init__.py": GOOD_ATTENTION,
                "fakeplug_wrong/attn.py": """
                    from heterollm.interfaces import AttentionBackend
                    class NotAnAttention:
                        pass
                    class Half(AttentionBackend):
                        platforms = ("cpu",)
                        @classmethod
                        def validate(cls, config):
                            return []
                """})
    reg = Registry.discover()
    assert "does not subclass heterollm.interfaces.AttentionBackend" in reg.candidates("attention", "wrong")[0].error
    half = reg.candidates("attention", "half")[0].error
    assert "unimplemented" in half and "forward" in half


def test_api_version_checked_before_import(fake_dists, tmp_path):
    marker = tmp_path / "imported"
    fake_dists("fakeplug-old", "9.0", {"heterollm.attention": {"old": "fakeplug_old.attn:Attn"}},
               {"fakeplug_old/__init__.py": '__heterollm_api__ = ">=0.1,<1.0"\n',
                "fakeplug_old/attn.py": f"open({str(marker)!r}, 'w').write('x')\n"})
    reg = Registry.discover()
    err = reg.candidates("attention", "old")[0].error
    assert "contract version mismatch" in err and ">=0.1,<1.0" in err
    assert not marker.exists(), "the entry's module must not be imported when the contract range mismatches"


def test_missing_api_declaration(fake_dists):
    fake_dists("fakeplug-undeclared", "1.0", {"heterollm.attention": {"undeclared": "fakeplug_und.attn:A"}},
               {"fakeplug_und/__init__.py": "", "fakeplug_und/attn.py": "A = 1\n"})
    err = Registry.discover().candidates("attention", "undeclared")[0].error
    assert "__heterollm_api__" in err


def test_duplicate_registration_reports_both_origins(fake_dists):
    fake_dists("fakeplug-dupe", "2.0", {"heterollm.attention": {"example": "fakeplug_dupe.attn:FakeAttention"}},
               {"fakeplug_dupe/__init__.py": GOOD_ATTENTION, "fakeplug_dupe/attn.py": ATTN_MODULE})
    reg = Registry.discover()
    [message] = [m for m in reg.duplicates() if "'example'" in m]
    assert "heterollm-example-attention" in message and "fakeplug-dupe 2.0" in message
    with pytest.raises(LaunchError, match="registered by both"):
        resolve(cfg("--extension_impl=example"), reg)
    # not selected: the rest still resolves
    assert resolve(cfg(), reg).components["attention"].name == "cpu"


def test_family_without_component_for_platform(fake_dists):
    fake_dists("fakeplug-gpuonly", "1.0", {"heterollm.attention": {"gpuonly": "fakeplug_gpu.attn:GpuAttention"}},
               {"fakeplug_gpu/__init__.py": GOOD_ATTENTION, "fakeplug_gpu/attn.py": """
                    from heterollm_cpu.attention import CpuPagedAttention
                    class GpuAttention(CpuPagedAttention):
                        platforms = ("cuda",)
                """})
    with pytest.raises(LaunchError, match="has no component for platform cpu"):
        resolve(cfg("--extension_impl=gpuonly"), Registry.discover())


def test_unavailable_platform_named(fake_dists):
    fake_dists("fakeplug-npu", "1.0", {"heterollm.platforms": {"fakenpu": "fakeplug_npu.platform:FakeNpu"}},
               {"fakeplug_npu/__init__.py": GOOD_ATTENTION, "fakeplug_npu/platform.py": """
                    from heterollm_cpu.platform import CpuPlatform
                    class FakeNpu(CpuPlatform):
                        name = "fakenpu"
                        device_type = "npu"
                        dist_backend = "hccl"
                        default_impl = "npu"
                        def is_available(self):
                            return False
                        def unavailable_reason(self):
                            return "torch_npu not importable"
                """})
    reg = Registry.discover()
    with pytest.raises(LaunchError, match="torch_npu not importable"):
        resolve(cfg("--device=fakenpu"), reg)
    assert resolve(cfg("--device=auto"), reg).platform.name == "cpu"


def test_backends_command(cli, fake_dists):
    root = fake_dists("fakeplug-broken2", "0.1", {"heterollm.attention": {"broken2": "fakeplug_b2.attn:A"}},
                      {"fakeplug_b2/__init__.py": GOOD_ATTENTION, "fakeplug_b2/attn.py": "import no_such_sdk\n"})
    r = cli("backends", extra_path=root)
    assert r.rc == 0, r.err
    assert "heterollm-cpu" in r.out and "heterollm-example-attention" in r.out
    assert "usable" in r.out and "broken2" in r.out and "no_such_sdk" in r.out
    assert "Traceback" not in r.out + r.err
