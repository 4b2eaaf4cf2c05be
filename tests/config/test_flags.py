"""Flag parsing, precedence (CLI > JSON > default) for every flag, dump/reload, aliases, bools."""
from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from heterollm.config import FLAG_SPECS, ConfigError, dump_config, load_config, parse_flags
from heterollm.config.base import flag_choices
from heterollm.config.schema import FLAG_ALIASES


def _validates(spec, value: Any) -> bool:
    try:
        spec.group_cls.model_validate({spec.name: value})
        return True
    except ValidationError:
        return False


def normalized(spec, value: Any) -> Any:
    return spec.group_cls.model_validate({spec.name: value}).model_dump(mode="json")[spec.name]


def alternatives(spec) -> list[Any]:
    """Valid non-default values for a flag (two distinct ones where the type has them), found by
    trying typical candidates."""
    default = spec.default
    if spec.is_bool:
        return [not default]
    choices = flag_choices(spec.field)
    if default is None:
        cands = ["alpha", "beta", 2, 3, 8002, 8003, 0.5, 1.5, {"a": 1}, {"b": 2}]
    elif choices:
        cands: list[Any] = [c for c in choices if c != default]
    elif isinstance(default, bool):
        cands = []
    elif isinstance(default, int):
        cands = [default + 1, default + 2, default - 1, 1, 2, 3]
    elif isinstance(default, float):
        cands = [default / 2, default / 4, default + 0.5, 0.5, 0.25, 2.0]
    elif spec.name == "kv_events_config":
        cands = ['{"endpoint": "tcp://*:5557"}', '{"endpoint": "tcp://*:6000", "hwm": 5}']
    else:
        cands = ["alpha", "beta", '{"a": 1}', '{"b": 2}', "tcp://a:1", "tcp://b:2"]
    found = []
    for c in cands:
        if c != default and c not in found and _validates(spec, c):
            found.append(c)
    return found


ALL_FLAGS = sorted(FLAG_SPECS)


def test_flag_table_is_complete():
    assert len(FLAG_SPECS) >= 200
    for name in ("model", "block_size", "max_memory_utilization", "kv_events_config", "max_model_len",
                 "served_model_name", "chat_template", "metrics_port", "num_gpu_blocks_override",
                 "guided_decoding_backend", "enable_logprob", "quantization", "extension_impl", "device"):
        assert name in FLAG_SPECS, name
    for name, spec in FLAG_SPECS.items():
        assert spec.field.description, f"{name} has no description"


@pytest.mark.parametrize("name", ALL_FLAGS)
def test_precedence_per_flag(name, tmp_path):
    spec = FLAG_SPECS[name]
    if name == "config_json_file":
        pytest.skip("names the file itself")
    alts = alternatives(spec)
    assert alts, f"no valid non-default value found for {name}"
    # the CLI value differs from the JSON one: a second alternative, or (a bool) the default spelled out
    json_value, cli_value = alts[0], alts[1] if len(alts) > 1 else spec.default
    assert normalized(spec, cli_value) != normalized(spec, json_value), name
    cfg_file = tmp_path / "c.json"
    cfg_file.write_text(json.dumps({name: json_value}))

    def cli_args(v):
        shown = str(v).lower() if isinstance(v, bool) else json.dumps(v) if isinstance(v, dict) else v
        return [f"--{name}={shown}"]

    default_only = load_config([])
    assert default_only.config.flat()[name] == spec.default and default_only.sources[name] == "default"
    from_json = load_config(["--config_json_file", str(cfg_file)])
    assert from_json.config.flat()[name] == normalized(spec, json_value) and from_json.sources[name] == "json"
    both = load_config(["--config_json_file", str(cfg_file), *cli_args(cli_value)])
    assert both.config.flat()[name] == normalized(spec, cli_value) and both.sources[name] == "cli"
    # a JSON value for one flag does not disturb another flag's default
    other = "block_size" if name != "block_size" else "max_seqs_per_batch"
    assert from_json.sources[other] == "default"


def test_dump_then_reload_round_trip(tmp_path):
    argv = ["--model", "m", "--block_size=16", "--noenable_prefix_cache", "--max-model-len", "4096",
            "--kv_events_config", '{"endpoint": "tcp://*:5557", "hwm": 7}', "--dtype=float32",
            "--max_memory_utilization", "0.5"]
    first = load_config(argv).config
    path = dump_config(first, tmp_path / "dump.json")
    reloaded = load_config(["--config_json_file", str(path)])
    again = reloaded.config.flat()
    # the only difference is the flag that names the file being read
    assert again.pop("config_json_file") == str(path)
    expected = first.flat()
    expected.pop("config_json_file")
    assert again == expected
    assert all(reloaded.sources[k] in ("json", "default") for k in expected)


@pytest.mark.slow  # 7 s: a CLI subprocess (the JSON layer itself is tested in the default run)
def test_cli_dump_flag_writes_default_file(cli, tmp_path):
    r = cli("config", "--model", "m", "--block_size", "32", "--enable_dump_config_json", cwd=tmp_path)
    assert r.rc == 0, r.err
    data = json.loads((tmp_path / "xllm_config.json").read_text())
    assert data["block_size"] == 32 and data["model"] == "m"
    r2 = cli("config", "--config_json_file", "xllm_config.json", cwd=tmp_path)
    assert r2.rc == 0, r2.err
    shown = json.loads(r2.out)["config"]
    assert shown["kv_cache"]["block_size"] == {"value": 32, "source": "json"}


@pytest.mark.parametrize("argv,expected", [
    (["--enable_prefix_cache"], True),
    (["--enable_prefix_cache=true"], True),
    (["--enable_prefix_cache=false"], False),
    (["--enable_prefix_cache=False"], False),
    (["--enable_prefix_cache", "false"], False),
    (["--enable_prefix_cache", "true"], True),
    (["--noenable_prefix_cache"], False),
    (["--enable-prefix-cache=0"], False),
    (["--noenable-prefix-cache"], False),
])
def test_bool_spellings(argv, expected):
    assert load_config(argv).config.kv_cache.enable_prefix_cache is expected


def test_bool_followed_by_next_flag():
    cfg = load_config(["--enable_prefix_cache", "--block_size", "8"]).config
    assert cfg.kv_cache.enable_prefix_cache is True and cfg.kv_cache.block_size == 8


def test_value_spellings_and_dashes():
    a = load_config(["--max-model-len=1024"]).config
    b = load_config(["--max_model_len", "1024"]).config
    assert a == b and a.fastdeploy.max_model_len == 1024


@pytest.mark.parametrize("alias,canonical,value", [
    ("tensor_parallel_size", "tp_size", 2),
    ("tensor-parallel-size", "tp_size", 2),
    ("max_num_seqs", "max_seqs_per_batch", 7),
    ("max_num_batched_tokens", "max_tokens_per_batch", 512),
    ("gpu_memory_utilization", "max_memory_utilization", 0.5),
    ("gpu-memory-utilization", "max_memory_utilization", 0.5),
    ("enable_prefix_caching", "enable_prefix_cache", False),
    ("use_cudagraph", "enable_graph", True),
    ("data_parallel_size", "dp_size", 2),
])
def test_fastdeploy_aliases(alias, canonical, value):
    raw = str(value).lower() if isinstance(value, bool) else str(value)
    loaded = load_config([f"--{alias}={raw}"])
    assert loaded.config.flat()[canonical] == value
    assert loaded.sources[canonical] == "cli"
    assert FLAG_ALIASES[alias.replace("-", "_")] == canonical


def test_alias_in_json_file(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"max_num_seqs": 9, "gpu-memory-utilization": 0.3}))
    cfg = load_config(["--config_json_file", str(p)]).config
    assert cfg.scheduler.max_seqs_per_batch == 9 and cfg.kv_cache.max_memory_utilization == 0.3


def test_kv_events_config_parsed():
    cfg = load_config(["--kv_events_config", '{"endpoint": "tcp://*:5557"}']).config
    from heterollm.config.cache import parse_kv_events_config
    events = parse_kv_events_config(cfg.kv_cache.kv_events_config)
    assert events.endpoint == "tcp://*:5557" and events.hwm == 10000


@pytest.mark.parametrize("argv,needle", [
    (["--max_memory_utilization=0"], "--max_memory_utilization"),
    (["--max_memory_utilization=1.5"], "--max_memory_utilization"),
    (["--block_size=0"], "--block_size"),
    (["--block_size=-4"], "--block_size"),
    (["--block_size=abc"], "--block_size"),
    (["--kv_events_config", '{"endpoint": "tcp://*:1", "hwm": 0}'], "--kv_events_config"),
    (["--kv_events_config", "[1, 2]"], "--kv_events_config"),
    (["--kv_events_config", "not json"], "--kv_events_config"),
    (["--kv_events_config", '{"endpoint": "tcp://*:5557", "motor_pool_endpoint": "tcp://*:7557"}'],
     "motor_pool_endpoint"),
    (["--kv_events_config", '{"endpoint": "tcp://*"}'], "endpoint"),
    (["--dit_sparse_attention_sparsity=1"], "--dit_sparse_attention_sparsity"),
    (["--dit_sparse_attention_sparsity=-0.1"], "--dit_sparse_attention_sparsity"),
    (["--enable_prefix_cache=maybe"], "--enable_prefix_cache"),
    (["--max_model_lenn=5"], "--max_model_len"),
    (["--dtype=float8"], "--dtype"),
    (["--block_size"], "--block_size"),
    (["positional"], "positional"),
])
def test_bad_values_name_the_flag(argv, needle):
    with pytest.raises(ConfigError) as info:
        load_config(argv)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_json_errors_name_the_file(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"block_size": 0}))
    with pytest.raises(ConfigError, match=r"--block_size.*from --config_json_file"):
        load_config(["--config_json_file", str(p)])
    p.write_text(json.dumps({"no_such_flag": 1}))
    with pytest.raises(ConfigError, match="no_such_flag"):
        load_config(["--config_json_file", str(p)])
    p.write_text("{oops")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(["--config_json_file", str(p)])
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(["--config_json_file", str(tmp_path / "missing.json")])


def test_parse_flags_negation_only_for_bools():
    with pytest.raises(ConfigError, match="unknown flag"):
        parse_flags(["--noblock_size"])


def _spec_flags() -> dict[str, str]:
    """Every flag of the xLLM table (spec/xllm_flags.md) -> its default as the spec writes it."""
    from pathlib import Path

    spec = Path(__file__).resolve().parents[3] / "shared" / "spec" / "xllm_flags.md"
    if not spec.exists():
        pytest.skip(f"the flag table is not beside this checkout ({spec})")
    out, section = {}, ""
    for line in spec.read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            section = line
        elif line.startswith("| ") and "kv_events_config fields" not in section:
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) >= 3 and cells[0] not in ("参数名称", "字段") and not cells[0].startswith("---"):
                out[cells[0]] = cells[2]
    return out


def _spec_default(text: str) -> Any:
    text = text.strip()
    if text in ("true", "false"):
        return text == "true"
    if text.startswith('"') and text.endswith('"'):
        return text[1:-1]
    if text == "std::numeric_limits<int32_t>::max()":
        return 2**31 - 1
    try:
        return int(text)
    except ValueError:
        return float(text)


def test_the_dump_holds_every_xllm_flag_with_the_spec_default(cli, tmp_path):
    """With the four backend wheels installed (scripts/setup.sh), `heterollm config --enable_dump_config_json`
    writes every flag of the xLLM table, NPU-, CUDA- and MLU-owned ones included, at the spec's default."""
    table = _spec_flags()
    assert len(table) >= 160
    r = cli("config", "--model", "m", "--enable_dump_config_json", cwd=tmp_path)
    assert r.rc == 0, r.err
    dumped = json.loads((tmp_path / "xllm_config.json").read_text())
    missing = sorted(set(table) - set(dumped))
    assert not missing, missing
    overridden = {"model": "m", "enable_dump_config_json": True}
    wrong = {n: (dumped[n], d) for n, d in table.items() if n not in overridden and dumped[n] != _spec_default(d)}
    assert not wrong, wrong


def test_a_backend_flag_without_its_wheel_names_the_distribution():
    """Only the CPU wheel installed: an NPU-owned flag is not in the config, and setting it names heterollm-npu."""
    from heterollm.config.loader import FlagTable
    from heterollm.config.schema import build_schema, schema_groups
    from heterollm.plugins import Registry

    registry = Registry.discover()
    registry.backends = [b for b in registry.backends if b.name in ("cpu", "core")]
    schema = build_schema(schema_groups(registry))
    assert "enable_fused_mc2" not in schema.specs and "npu" not in schema.groups
    with pytest.raises(ConfigError, match=r"--enable_fused_mc2: belongs to heterollm-npu, which is not installed"):
        load_config(["--enable_fused_mc2=1"], table=FlagTable(schema=schema))
    with pytest.raises(ConfigError, match=r"belongs to heterollm-cuda, which is not installed"):
        load_config(["--enable-custom-all-reduce"], table=FlagTable(schema=schema))
    assert load_config([], table=FlagTable(schema=schema)).config.flat()["block_size"] == 128


def test_backend_groups_join_the_config_and_survive_pickling():
    import pickle

    config = load_config(["--template_fast_path", "--enable_fused_mc2=2"]).config
    assert config.template.template_fast_path is True and config.npu.enable_fused_mc2 == 2
    assert FLAG_SPECS["enable_fused_mc2"].owner == "heterollm-npu"
    assert FLAG_SPECS["block_size"].owner == ""
    assert pickle.loads(pickle.dumps(config)) == config  # worker processes rebuild the composed class
