"""Discovery of backend descriptors, extension_impl resolution per component and per model
architecture, backend-owned flags, and failure reporting of the plugin registry."""
from __future__ import annotations

import pytest

from heterollm.config import load_config
from heterollm.plugins import LaunchError, Registry, resolve

ATTN_MODULE = """
from heterollm_cpu.attention import CpuPagedAttention

class FakeAttention(CpuPagedAttention):
    pass
"""


def descriptor(name: str, body: str, api: str = ">=2.0,<3") -> str:
    """A package __init__ holding a Backend descriptor (as a vendor's wheel ships it)."""
    return (f"from heterollm.interfaces.backend import Backend\n"
            f"BACKEND = Backend(name={name!r}, api_version={api!r}, {body})\n")


def add_backend(fake_dists, dist: str, name: str, body: str, modules: dict[str, str] | None = None,
                api: str = ">=2.0,<3", version: str = "1.0"):
    package = dist.replace("-", "_")
    return fake_dists(dist, version, {"heterollm.backends": {name: f"{package}:BACKEND"}},
                      {f"{package}/__init__.py": descriptor(name, body, api), **(modules or {})})


def cfg(*argv):
    return load_config(["--model", "m", *argv]).config


def test_installed_backends_discovered():
    reg = Registry.discover()
    cpu = reg.get("platforms", "cpu")
    assert cpu is not None and cpu.dist == "heterollm-cpu" and cpu.version
    for group in ("attention", "graph_runners", "communicators", "executors"):
        assert reg.get(group, "cpu").dist == "heterollm-cpu"
    example = reg.get("attention", "example")
    assert example is not None and example.dist == "heterollm-example-attention" and example.runs_on == ("cpu",)
    assert reg.families() == sorted(set(reg.families())) and {"cpu", "example", "core"} <= set(reg.families())
    assert {b.name for b in reg.backends} >= {"cpu", "cuda", "npu", "mlu", "template", "example", "core"}
    assert reg.get("models", "LlamaForCausalLM", "core").dist == "heterollm"
    assert reg.get("models", "LlamaForCausalLM", "template").dist == "heterollm-backend-template"


def test_default_family_resolution():
    sel = resolve(cfg(), Registry.discover())
    assert sel.platform.name == "cpu" and sel.platform.dist_backend == "gloo"
    assert {g: e.name for g, e in sel.components.items()} == {
        "attention": "cpu", "graph_runners": "cpu", "communicators": "cpu", "executors": "cpu"}
    assert sel.as_dict()["components"]["attention"]["origin"].startswith("heterollm-cpu")
    assert sel.backends == ("cpu",)


def test_partial_family_falls_back_per_group():
    sel = resolve(cfg("--extension_impl=example"), Registry.discover())
    assert sel.components["attention"].name == "example"
    assert sel.components["attention"].dist == "heterollm-example-attention"
    assert sel.components["executors"].name == "cpu"
    assert sel.components["graph_runners"].name == "cpu"
    assert set(sel.backends) == {"cpu", "example"}


def test_unknown_family_lists_installed():
    with pytest.raises(LaunchError) as info:
        resolve(cfg("--extension_impl=nosuch"), Registry.discover())
    msg = str(info.value)
    assert "--extension_impl=nosuch" in msg and "cpu" in msg and "example" in msg and "\n" not in msg


def test_missing_platform_lists_installed():
    with pytest.raises(LaunchError) as info:
        resolve(cfg("--device=xpu"), Registry.discover())
    assert "no platform 'xpu' is installed" in str(info.value) and "cpu (heterollm-cpu" in str(info.value)


def test_component_validate_and_backend_reasons_collected():
    with pytest.raises(LaunchError) as info:
        resolve(cfg("--extension_impl=example", "--block_size=2048", "--enable_fused_mc2=1",
                    "--enable_graph_mode_decode_no_padding"),
                Registry.discover())
    reasons = info.value.reasons
    assert any(r.startswith("attention example: block_size 2048") for r in reasons)
    assert any(r.startswith("--enable_fused_mc2=1: belongs to heterollm-npu") for r in reasons)
    assert any(r.startswith("--enable_graph_mode_decode_no_padding=true:") and "heterollm-cpu, selected" in r
               for r in reasons)


def test_backend_flags_live_only_when_its_backend_is_selected():
    """The template's own flag: refused on cpu, accepted (and read) on the template platform."""
    with pytest.raises(LaunchError, match="--template_fast_path=true: belongs to heterollm-backend-template"):
        resolve(cfg("--template_fast_path"), Registry.discover())
    sel = resolve(cfg("--device=template", "--template_fast_path"), Registry.discover())
    assert sel.platform.name == "template" and "template" in sel.backends


def test_unsupported_flags_of_the_selected_backend():
    with pytest.raises(LaunchError, match="--enable_graph=true: the template runs every step eagerly"):
        resolve(cfg("--device=template", "--enable_graph"), Registry.discover())
    with pytest.raises(LaunchError, match="--enable_graph_mode_decode_no_padding=true: device graphs only"):
        resolve(cfg("--enable_graph", "--enable_graph_mode_decode_no_padding"), Registry.discover())


def test_models_resolve_per_architecture_and_family():
    reg = Registry.discover()
    on_template = resolve(cfg("--device=template"), reg, ["LlamaForCausalLM"])
    assert on_template.model.family == "template" and on_template.model.dist == "heterollm-backend-template"
    assert "model LlamaForCausalLM: template" in on_template.describe()
    # an architecture the family does not implement falls back to the core's
    qwen = resolve(cfg("--device=template", "--extension_impl=template"), reg, ["Qwen2ForCausalLM"])
    assert qwen.model.family == "core" and qwen.model.dist == "heterollm"
    # on the CPU the template's model is not a candidate (it runs on its own platform only)
    assert resolve(cfg(), reg, ["LlamaForCausalLM"]).model.family == "core"
    assert resolve(cfg(), reg, ["NoSuchForCausalLM"]).model is None


def test_duplicate_model_of_one_family_is_refused_with_both_origins(fake_dists):
    add_backend(fake_dists, "fakeplug-llama", "template",
                'platforms=("template",), models={"LlamaForCausalLM": "fakeplug_llama.m:Llama"}',
                {"fakeplug_llama/m.py": "from heterollm.model_executor.models.llama import LlamaForCausalLM as Llama\n"})
    reg = Registry.discover()
    assert any("'LlamaForCausalLM' of family 'template'" in m and "fakeplug-llama 1.0" in m
               and "heterollm-backend-template" in m for m in reg.duplicates())
    with pytest.raises(LaunchError) as info:
        resolve(cfg("--device=template"), reg, ["LlamaForCausalLM"])
    assert "'LlamaForCausalLM' of family 'template' is registered by both" in str(info.value)
    assert "heterollm-backend-template 0.1.0" in str(info.value) and "fakeplug-llama 1.0" in str(info.value)
    assert resolve(cfg("--device=template"), reg, ["Qwen3ForCausalLM"]).model.family == "core"


def test_model_only_family(fake_dists):
    """A vendor ships one architecture for the CPU and nothing else: --extension_impl picks it."""
    add_backend(fake_dists, "fakeplug-qwen", "fastqwen",
                'platforms=("cpu",), models={"Qwen3ForCausalLM": "fakeplug_qwen.m:Qwen3"}',
                {"fakeplug_qwen/m.py": "from heterollm.model_executor.models.llama import Qwen3ForCausalLM as Qwen3\n"})
    reg = Registry.discover()
    sel = resolve(cfg("--extension_impl=fastqwen"), reg, ["Qwen3ForCausalLM"])
    assert sel.model.family == "fastqwen" and sel.components["attention"].name == "cpu"
    assert "fastqwen" in sel.backends
    with pytest.raises(LaunchError, match="family 'fastqwen' has no component for platform cpu"):
        resolve(cfg("--extension_impl=fastqwen"), reg, ["LlamaForCausalLM"])


def test_broken_plugin_reported_and_skipped(fake_dists):
    add_backend(fake_dists, "fakeplug-broken", "broken", 'platforms=("cpu",), components={"attention": '
                '"fakeplug_broken.attn:Attn"}', {"fakeplug_broken/attn.py": "raise RuntimeError('vendor SDK missing')\n"},
                version="0.3")
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
    add_backend(fake_dists, "fakeplug-wrong", "wrong", 'platforms=("cpu",), components={'
                '"attention": "fakeplug_wrong.attn:NotAnAttention", "executors": "fakeplug_wrong.attn:Half", '
                '"kernels": "fakeplug_wrong.attn:Half"}', {"fakeplug_wrong/attn.py": """
                    from heterollm.interfaces import Executor
                    class NotAnAttention:
                        pass
                    class Half(Executor):
                        @classmethod
                        def validate(cls, config):
                            return []
                """})
    reg = Registry.discover()
    assert "does not subclass heterollm.interfaces.AttentionBackend" in reg.candidates("attention", "wrong")[0].error
    half = reg.candidates("executors", "wrong")[0].error
    assert "unimplemented" in half and "execute" in half
    assert "unknown component group 'kernels'" in reg.candidates("kernels", "wrong")[0].error


def test_not_a_descriptor_is_reported(fake_dists):
    fake_dists("fakeplug-notdesc", "1.0", {"heterollm.backends": {"notdesc": "fakeplug_notdesc:BACKEND"}},
               {"fakeplug_notdesc/__init__.py": "BACKEND = {'name': 'notdesc'}\n"})
    [info] = [b for b in Registry.discover().backends if b.dist == "fakeplug-notdesc"]
    assert "not a heterollm.interfaces.Backend descriptor" in info.error


def test_api_version_checked_before_import(fake_dists, tmp_path):
    marker = tmp_path / "imported"
    add_backend(fake_dists, "fakeplug-old", "old", 'platforms=("cpu",), components={"attention": '
                '"fakeplug_old.attn:Attn"}', {"fakeplug_old/attn.py": f"open({str(marker)!r}, 'w').write('x')\n"},
                api=">=1.0,<2", version="9.0")
    reg = Registry.discover()
    [info] = [b for b in reg.backends if b.dist == "fakeplug-old"]
    assert "contract version mismatch" in info.error and ">=1.0,<2" in info.error
    assert not reg.candidates("attention", "old")
    assert not marker.exists(), "a class of a backend whose contract range mismatches must not be imported"


def test_invalid_api_range_is_reported(fake_dists):
    add_backend(fake_dists, "fakeplug-badrange", "badrange", "", api="two")
    [info] = [b for b in Registry.discover().backends if b.dist == "fakeplug-badrange"]
    assert "invalid contract range 'two'" in info.error


def test_duplicate_registration_reports_both_origins(fake_dists):
    add_backend(fake_dists, "fakeplug-dupe", "example", 'platforms=("cpu",), components={"attention": '
                '"fakeplug_dupe.attn:FakeAttention"}', {"fakeplug_dupe/attn.py": ATTN_MODULE}, version="2.0")
    reg = Registry.discover()
    [message] = [m for m in reg.duplicates() if "attention entry 'example'" in m]
    assert "heterollm-example-attention" in message and "fakeplug-dupe 2.0" in message
    with pytest.raises(LaunchError, match="registered by both"):
        resolve(cfg("--extension_impl=example"), reg)
    # not selected: the rest still resolves
    assert resolve(cfg(), reg).components["attention"].name == "cpu"


def test_family_without_component_for_platform(fake_dists):
    add_backend(fake_dists, "fakeplug-gpuonly", "gpuonly", 'platforms=("cuda",), components={"attention": '
                '"fakeplug_gpuonly.attn:FakeAttention"}', {"fakeplug_gpuonly/attn.py": ATTN_MODULE})
    with pytest.raises(LaunchError, match="has no component for platform cpu"):
        resolve(cfg("--extension_impl=gpuonly"), Registry.discover())


def test_platform_name_must_match_the_descriptor(fake_dists):
    add_backend(fake_dists, "fakeplug-misnamed", "misnamed", 'platform="fakeplug_misnamed.p:P"',
                {"fakeplug_misnamed/p.py": "from heterollm_cpu.platform import CpuPlatform as P\n"})
    [entry] = Registry.discover().candidates("platforms", "misnamed")
    assert "is named 'cpu', not 'misnamed'" in entry.error


def test_unavailable_platform_named(fake_dists):
    add_backend(fake_dists, "fakeplug-npu", "fakenpu", 'platform="fakeplug_npu.platform:FakeNpu"',
                {"fakeplug_npu/platform.py": """
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
    root = add_backend(fake_dists, "fakeplug-broken2", "broken2", 'platforms=("cpu",), components={"attention": '
                       '"fakeplug_broken2.attn:A"}', {"fakeplug_broken2/attn.py": "import no_such_sdk\n"}, version="0.1")
    r = cli("backends", extra_path=root)
    assert r.rc == 0, r.err
    assert "heterollm-cpu" in r.out and "heterollm-example-attention" in r.out
    assert "usable" in r.out and "broken2" in r.out and "no_such_sdk" in r.out
    assert "LlamaForCausalLM" in r.out and "template (heterollm-backend-template" in r.out
    assert "template_fast_path" in r.out
    assert "Traceback" not in r.out + r.err


def test_discovering_every_backend_does_not_import_dynamo():
    """An API server loads every installed backend's entry points to check its flags, and its imports
    are start-up time before the engine core spawns: torch._dynamo alone is ~1.7 s on 2 cores
    (torch.nn.attention's bias and varlen modules import it; the attention backends import those at
    their first use)."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from heterollm.config import load_config\n"
            "from heterollm.plugins import resolve\n"
            "import heterollm.engine.core_client, heterollm.entrypoints.openai.server\n"
            "loaded = load_config(['--model', '/nonexistent/model'])\n"
            "assert len([m for m in sys.modules if m.startswith('heterollm_')]) > 10\n"
            "print(sorted(m for m in sys.modules if m.startswith('torch._dynamo')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout
