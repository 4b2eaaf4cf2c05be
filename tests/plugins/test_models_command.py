"""`heterollm models`: every registered architecture with its family, origin distribution and class,
as `heterollm backends` lists components."""
from __future__ import annotations

from test_registry import add_backend

from heterollm.model_executor.models import CORE_BACKEND


def rows(out: str) -> dict[tuple[str, str], str]:
    """(architecture, family) -> the rest of its row."""
    found = {}
    for line in out.splitlines()[2:]:
        parts = line.split()
        if len(parts) >= 4 and not line.startswith("   " + " " * 36):
            found[(parts[0], parts[1])] = " ".join(parts[2:])
    return found


def test_lists_every_core_architecture_with_its_origin(cli):
    res = cli("models")
    assert res.rc == 0, res.err
    table = rows(res.out)
    for arch, target in CORE_BACKEND.models.items():
        assert table[(arch, "core")].startswith("heterollm ") and table[(arch, "core")].endswith(target), arch


def test_a_vendor_architecture_shows_its_distribution(fake_dists, cli):
    root = add_backend(fake_dists, "fakeplug-qwen", "fastqwen",
                       'platforms=("cpu",), models={"Qwen3ForCausalLM": "fakeplug_qwen.m:Qwen3"}',
                       {"fakeplug_qwen/m.py": "from heterollm.model_executor.models.llama import Qwen3ForCausalLM as Qwen3\n"})
    res = cli("models", extra_path=root)
    assert res.rc == 0, res.err
    table = rows(res.out)
    assert table[("Qwen3ForCausalLM", "fastqwen")] == "fakeplug-qwen 1.0 fakeplug_qwen.m:Qwen3"
    assert ("Qwen3ForCausalLM", "core") in table
    assert "usable on cpu" in res.out.split("fakeplug_qwen.m:Qwen3", 1)[1].splitlines()[1]
