"""The backend conformance kit, run the way a vendor runs it, against the CPU reference and the
template backend (plugins/backend_template, installed by scripts/setup.sh)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from heterollm_cpu.platform import CpuPlatform


def run_kit(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "heterollm.testing.conformance", "--pyargs",
                           "heterollm.testing.conformance", "-p", "no:cacheprovider", *args],
                          capture_output=True, text=True, timeout=600, env=env)


# what each backend's kit run skips, and why (the window, score-cap and int8 cache checks skip twice
# each, MLA's thrice)
KIT_CHECKS = 23
SKIPS = {"cpu": ["'cpu' says float16 is not supported"]
               # bf16 is native with AVX-512-bf16 / AMX (an AVX2-only CPU emulates it: --dtype auto avoids it)
               + ([] if CpuPlatform().supports_dtype("bfloat16") else ["'cpu' says bfloat16 is not supported"]),
         "template": ["'template' says bfloat16 is not supported", "'template' says float16 is not supported",
                      "replays no decode step (an eager graph runner)",
                      "--enable_graph is refused by this backend: --enable_graph=true: the template runs every step "
                      "eagerly"] + ["TemplateAttention does not honour a sliding window"] * 2
                     + ["TemplateAttention does not cap attention scores"] * 2
                     + ["TemplateAttention does not implement MLA attention"] * 3
                     + ["TemplateAttention does not store an int8 KV cache"] * 2}


@pytest.mark.slow  # 12-21 s each: the whole kit in a subprocess (its attention checks also run in test_cpu_attention.py)
@pytest.mark.parametrize("device", ["cpu", "template"])
def test_backend_passes_the_kit(device):
    r = run_kit("--heterollm-device", device, "-rs")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    summary = r.stdout.strip().splitlines()[-1]
    assert f"{KIT_CHECKS - len(SKIPS[device])} passed" in summary and "failed" not in summary, r.stdout[-3000:]
    for reason in SKIPS[device]:
        assert reason in r.stdout


def kit_with_plugin(tmp_path, name: str, source: str, device: str, check: str) -> str:
    """Run the kit's `check` on `device` with `source` loaded into its process first (`-p name`),
    as a broken backend would be; asserts the run fails and returns its output."""
    (tmp_path / f"{name}.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))}
    r = run_kit("--heterollm-device", device, "-p", name, "-k", check, env=env)
    assert r.returncode == 1, r.stdout[-2000:] + r.stderr[-2000:]
    return r.stdout


def test_the_kit_catches_a_broken_kernel(tmp_path):
    """A backend whose attention ignores the cached context fails the attention check, by name."""
    out = kit_with_plugin(tmp_path, "broken_kernel",
                          "import heterollm_backend_template.attention as a\n"
                          "orig = a.TemplateAttention.forward\n"
                          "def broken(self, q, k, v, cache, meta, scale):\n"
                          "    meta.context_lens = [0] * len(meta.context_lens)\n"
                          "    return orig(self, q, k, v, cache, meta, scale)\n"
                          "a.TemplateAttention.forward = broken\n", "template", "attention")
    assert "FAILED" in out and "test_paged_attention_matches_dense_reference" in out


def test_the_kit_catches_a_device_mixing_sampler(tmp_path):
    """A sampler that builds its temperatures on the CPU (issue 18 defect 1) works on a CPU and
    crashes on an accelerator's first sampled request; the kit fails it on a CPU-only machine."""
    out = kit_with_plugin(tmp_path, "mixing_sampler",
                          "import torch\n"
                          "import heterollm.sampling.sampler as s\n"
                          "orig = s.sample_rows\n"
                          "def sample_rows(logits, rows):\n"
                          "    temps = torch.tensor([r.params.temperature for r in rows], dtype=logits.dtype)  # CPU\n"
                          "    return orig(logits / temps.unsqueeze(1) * temps.unsqueeze(1), rows)\n"
                          "s.sample_rows = sample_rows\n", "cpu", "sampler")
    assert "FAILED" in out and "test_sampler_keeps_every_tensor_on_the_logits_device" in out
    assert "DeviceMixingError" in out


@pytest.mark.slow  # 11 s; the kit catching a broken kernel stays in the default run
def test_the_kit_catches_a_graph_runner_that_never_replays(tmp_path):
    """A runner that says it can replay but runs every step eagerly (on a GPU: zero captures)
    fails the graph check."""
    out = kit_with_plugin(tmp_path, "lazy_runner",
                          "import heterollm_cpu.graph_runner as g\n"
                          "g.CpuGraphRunner.run = lambda self, forward, inputs: forward(inputs)\n", "cpu", "graph_runner")
    assert "every replayable decode step replayed" in out


def test_the_template_is_never_picked_by_auto():
    from heterollm.config import load_config
    from heterollm.plugins import resolve

    assert resolve(load_config([], overrides={"model": "x"}).config).platform.name == "cpu"
    assert resolve(load_config([], overrides={"model": "x", "device": "template"}).config).platform.name == "template"
