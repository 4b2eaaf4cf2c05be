"""Every CLI error path: one line on stderr naming the flag, exit code 2, no traceback. The table
runs the CLI's main() in this process (a fresh interpreter costs seconds each, mostly importing
torch); test_cli_error_in_its_own_process runs a few through `python -m heterollm.entrypoints.cli`."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from conftest import CliResult


def run_in_process(*args: str) -> CliResult:
    """The CLI's main() with its stdout and stderr captured: what the process would print and return."""
    from heterollm.entrypoints.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return CliResult(rc, out.getvalue(), err.getvalue())


@pytest.mark.parametrize("args,needle", [
    (["config"], "--model is required"),
    (["serve"], "--model is required"),
    (["generate", "--max_model_len=8"], "--model is required"),
    (["config", "--model", "m", "--max_modl_len=5"], "did you mean --max_model_len"),
    (["config", "--model", "m", "--max_memory_utilization=0"], "--max_memory_utilization"),
    (["config", "--model", "m", "--max_memory_utilization=1.01"], "--max_memory_utilization"),
    (["config", "--model", "m", "--block_size=0"], "--block_size"),
    (["config", "--model", "m", "--block_size=x"], "--block_size"),
    (["config", "--model", "m", "--kv_events_config", '{"endpoint":"tcp://*:1","hwm":0}'], "hwm"),
    (["config", "--model", "m", "--kv_events_config", "3"], "--kv_events_config"),
    (["config", "--model", "m", "--dit_sparse_attention_sparsity=1.0"], "--dit_sparse_attention_sparsity"),
    (["config", "--model", "m", "--config_json_file=/nonexistent.json"], "--config_json_file"),
    (["serve", "--model", "m", "--device=xpu"], "--device=xpu: no platform 'xpu' is installed"),
    (["serve", "--model", "m", "--device=npu"],
     "--device=npu: platform npu (heterollm-npu 0.1.0) is not usable here: torch_npu is not installed"),
    (["serve", "--model", "m", "--extension_impl=nosuch"], "--extension_impl=nosuch"),
    (["serve", "--model", "m", "--enable_fused_mc2=1"],
     "--enable_fused_mc2=1: belongs to heterollm-npu (backend 'npu'), which this launch does not use (platform: cpu)"),
    (["config", "--model", "m", "--enable_fused_mc2=1"], "--enable_fused_mc2=1: belongs to heterollm-npu"),
    (["config", "--model", "m", "--template_fast_path"], "--template_fast_path=true: belongs to heterollm-backend-template"),
    (["serve", "--model", "m", "--enable_graph_mode_decode_no_padding"],
     "--enable_graph_mode_decode_no_padding=true: device graphs only"),
    (["config", "--model", "m", "--device=xpu"], "--device=xpu: no platform 'xpu' is installed"),
    (["serve", "--model", "m", "--dit_cache_policy=x"], "--dit_cache_policy"),
    (["serve", "--model", "m", "--kv_events_config", '{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5557"}'],
     "--kv_events_config: field 'replay_endpoint' ports 5557 overlap field 'endpoint' ports 5557"),
    (["serve", "--model", "m", "--dp_size=2", "--kv_events_config",
      '{"endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'], "'replay_endpoint' ports 5558-5559 overlap"),
    (["config", "--model", "m", "--kv_events_config", '{"endpoint":"tcp://*:1","motor_pool_endpoint":"tcp://*:2"}'],
     "--kv_events_config: field 'motor_pool_endpoint': xLLM Motor"),
    (["nosuchcommand"], "unknown command"),
    (["backends", "--model", "m"], "takes no flags"),
])
def test_cli_error(args, needle):
    check_error(run_in_process(*args), needle)


def check_error(r: CliResult, needle: str) -> None:
    assert r.rc == 2, (r.rc, r.out, r.err)
    assert needle in r.err, r.err
    assert "Traceback" not in r.err and "Traceback" not in r.out
    assert r.err.startswith("heterollm: error: ")


@pytest.mark.parametrize("args,needle", [
    (["serve"], "--model is required"),
    (["config", "--model", "m", "--max_modl_len=5"], "did you mean --max_model_len"),
    (["serve", "--model", "m", "--device=npu"],
     "--device=npu: platform npu (heterollm-npu 0.1.0) is not usable here: torch_npu is not installed"),
])
def test_cli_error_in_its_own_process(cli, args, needle):
    """The exit status and stderr of the real process (the console script runs the same main())."""
    check_error(cli(*args), needle)


def test_cli_reports_all_launch_reasons_at_once():
    r = run_in_process("serve", "--model", "m", "--enable_fused_mc2=2", "--enable_graph_mode_decode_no_padding")
    assert r.rc == 2
    assert "--enable_fused_mc2" in r.err and "--enable_graph_mode_decode_no_padding" in r.err


def test_config_prints_sources(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"block_size": 64, "max_seqs_per_batch": 3}))
    r = run_in_process("config", "--model", "m", "--config_json_file", str(p), "--max-num-seqs", "5")
    assert r.rc == 0, r.err
    out = json.loads(r.out)["config"]
    assert out["kv_cache"]["block_size"] == {"value": 64, "source": "json"}
    assert out["scheduler"]["max_seqs_per_batch"] == {"value": 5, "source": "cli"}
    assert out["model"]["model"] == {"value": "m", "source": "cli"}
    assert out["scheduler"]["max_tokens_per_batch"]["source"] == "default"


def test_help(cli):
    r = cli("--help")
    assert r.rc == 0 and "serve" in r.out and "backends" in r.out
