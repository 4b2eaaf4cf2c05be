"""The CPU backend has glibc's malloc keep freed memory once an engine is in place
(heterollm_cpu.platform.keep_freed_memory): a prefill's activations above 32 MiB no longer fault their
pages in at every op. Each case runs in a fresh interpreter: the setting is process-wide."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")

PROBE = """
import resource, sys, torch
from heterollm_cpu.platform import keep_freed_memory
def faults():  # minor faults of a second 48 MiB tensor, written through, after the first one was freed
    x = torch.empty(8192, 3072, dtype=torch.bfloat16); x.fill_(1); del x
    r0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(8192, 3072, dtype=torch.bfloat16); x.fill_(1); del x
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - r0
before = faults()
kept = keep_freed_memory()
faults()
print(kept, before, faults())
"""


def _probe(**env):
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "HETEROLLM_CPU_KEEP_FREED"}
    out = subprocess.run([sys.executable, "-c", PROBE], env={**clean, **env}, capture_output=True, text=True,
                         timeout=120, check=True)
    kept, before, after = out.stdout.split()
    return kept == "True", int(before), int(after)


def test_freed_memory_is_reused_without_page_faults():
    kept, before, after = _probe()
    assert kept
    assert before > 5000  # 12,288 pages of 4 KiB, mapped anew: the cost this removes
    assert after < 100


@pytest.mark.parametrize("env", [{"HETEROLLM_CPU_KEEP_FREED": "0"}, {"MALLOC_TRIM_THRESHOLD_": "1048576"}])
def test_the_users_choice_wins(env):
    kept, before, after = _probe(**env)
    assert not kept
    if "HETEROLLM_CPU_KEEP_FREED" in env:
        assert after > 5000  # glibc's default: mapped and unmapped each time


def test_an_engine_start_applies_it():
    """The CPU graph runner's capture (after the weights and the KV cache) sets it, with or without
    --enable_graph."""
    code = ("from heterollm_cpu.graph_runner import CpuGraphRunner\n"
            "from heterollm_cpu import platform\n"
            "CpuGraphRunner().capture(None, [], None)\n"
            "print(platform._kept)\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "HETEROLLM_CPU_KEEP_FREED"}
    out = subprocess.run([sys.executable, "-c", code], env=clean, capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.split()[-1] == "True"
