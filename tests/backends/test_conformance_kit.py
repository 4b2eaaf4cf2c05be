"""The backend conformance kit, run the way a vendor runs it, against the CPU reference and the
template backend (plugins/backend_template, installed by scripts/setup.sh)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest


def run_kit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "heterollm.testing.conformance", "--pyargs",
                           "heterollm.testing.conformance", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.parametrize("device", ["cpu", "template"])
def test_backend_passes_the_kit(device):
    r = run_kit("--heterollm-device", device)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "7 passed" in r.stdout


def test_the_kit_catches_a_broken_kernel(tmp_path):
    """A backend whose attention ignores the cached context fails the attention check, by name."""
    (tmp_path / "broken_kernel.py").write_text(
        "import heterollm_backend_template.attention as a\n"
        "orig = a.TemplateAttention.forward\n"
        "def broken(self, q, k, v, cache, meta, scale):\n"
        "    meta.context_lens = [0] * len(meta.context_lens)\n"
        "    return orig(self, q, k, v, cache, meta, scale)\n"
        "a.TemplateAttention.forward = broken\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    r = run_kit("--heterollm-device", "template", "-p", "broken_kernel", "-k", "attention", env=env)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    assert "FAILED" in r.stdout and "test_paged_attention_matches_dense_reference" in r.stdout


def test_the_template_is_never_picked_by_auto():
    from heterollm.config import load_config
    from heterollm.plugins import resolve

    assert resolve(load_config([], overrides={"model": "x"}).config).platform.name == "cpu"
    assert resolve(load_config([], overrides={"model": "x", "device": "template"}).config).platform.name == "template"
