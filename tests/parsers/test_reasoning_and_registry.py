"""The reasoning parser (every --reasoning_parser name: one <think> format) on outputs written from
the families' templates, with the prompt deciding whether the answer starts inside the reasoning;
reasoning followed by tool calls; every streaming split adds up; and the registry: names, auto,
refusals naming the flag, the plugin hook and --tool_parser_plugin."""
from __future__ import annotations

import json
from pathlib import Path

import pluggy
import pytest

from heterollm.config import ConfigError
from heterollm.parsers import ChoiceParser, ParserRegistry, build_registry
from heterollm.parsers.registry import BUILTIN_REASONING_PARSERS, BUILTIN_TOOL_PARSERS
from heterollm.plugins import make_plugin_manager
from tool_fixtures import HERMES, PARIS, TOOLS

REASONING = {
    # name: (text, prompt ends inside <think>, reasoning, content)
    "model_opens": ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", False, "\nThe user wants 2+2.\n",
                    "\n\nIt is 4."),
    "template_opens": ("The user wants 2+2.\n</think>\n\nIt is 4.", True, "The user wants 2+2.\n", "\n\nIt is 4."),
    "no_reasoning": ("It is 4.", False, None, "It is 4."),
    "leading_space": ("\n<think>x y</think>It is 4.", False, "x y", "It is 4."),
    "cut_off": ("<think>\nStill thinking about", False, "\nStill thinking about", None),
    "cut_off_open": ("Still thinking about </thi", True, "Still thinking about </thi", None),
    "empty_block": ("<think>\n\n</think>\n\nIt is 4.", False, None, "\n\nIt is 4."),
}
PROMPTS = {
    # the end of prompts as the templates render them -> does the answer start in the reasoning?
    "<|im_start|>assistant\n": False,  # Qwen3, thinking on: the model writes <think>
    "<|im_start|>assistant\n<think>\n\n</think>\n\n": False,  # Qwen3 / 3.5, enable_thinking false
    "<|im_start|>assistant\n<think>\n": True,  # Qwen3.5 thinking, QwQ
    "<｜Assistant｜><think>\n": True,  # DeepSeek-R1 (0528)
    "<|assistant|><think>": True,  # GLM-4.7 / 5 thinking
    "<|assistant|>\n<think></think>": False,  # GLM-4.5 /nothink
}


def think(name="qwen3"):
    return ParserRegistry().reasoning_parser(name, "")


def pieces_result(p: ChoiceParser, pieces: list[str]):
    text, reasoning, content, calls = "", "", "", []
    for i, piece in enumerate(pieces):
        text += piece
        d = p.update(text, i == len(pieces) - 1)
        reasoning, content, calls = reasoning + d.reasoning, content + d.content, calls + d.calls
    return reasoning or None, content or None, [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize("name", sorted(BUILTIN_REASONING_PARSERS))
@pytest.mark.parametrize("case", sorted(REASONING))
def test_reasoning_whole_and_streamed(name, case):
    text, opened, reasoning, content = REASONING[case]
    parser = think(name)
    parsed = ChoiceParser(parser, opened).result(text)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)
    for i in range(len(text) + 1):
        assert pieces_result(ChoiceParser(parser, opened), [text[:i], text[i:]]) == (reasoning, content, [])
    assert pieces_result(ChoiceParser(parser, opened), list(text)) == (reasoning, content, [])


@pytest.mark.parametrize("prompt,opened", PROMPTS.items())
def test_the_prompt_says_where_the_answer_starts(prompt, opened):
    assert think().starts_in_reasoning("<|im_start|>user\nhi<|im_end|>\n" + prompt) is opened


def test_reasoning_then_tool_calls_in_one_answer():
    text = "<think>\nI need the weather.\n</think>\n\n" + HERMES["parallel"][0]
    registry = ParserRegistry()
    make = lambda: ChoiceParser(registry.reasoning_parser("qwen3", ""), False, registry.tool_parser("qwen3", "", ""),
                                TOOLS)
    parsed = make().result(text)
    assert parsed.reasoning == "\nI need the weather.\n" and parsed.content is None
    assert [c.name for c in parsed.calls] == ["get_weather", "get_weather"]
    want = ("\nI need the weather.\n", None, [(c.name, json.loads(c.arguments)) for c in parsed.calls])
    assert pieces_result(make(), list(text)) == want
    for i in range(len(text) + 1):
        assert pieces_result(make(), [text[:i], text[i:]]) == want


def test_every_flag_name_resolves():
    registry = ParserRegistry()
    for name in ("qwen25", "qwen3", "qwen35", "qwen3_coder", "kimi_k2", "deepseekv3", "deepseekv32", "deepseekv4",
                 "deepseekv41", "glm45", "glm47", "glm5", "hermes", "llama3_json", "mistral", "pythonic"):
        assert registry.tool_parser(name, "", "").name == name
    for name in ("qwen3", "qwen35", "deepseek-r1", "glm45", "glm47", "glm5"):
        assert registry.reasoning_parser(name, "").name == name
    assert set(BUILTIN_TOOL_PARSERS) >= {"qwen25", "glm5"}


@pytest.mark.parametrize("template,model_type,expected", [
    ("{{ '<tool_call>\\n' }}{{ tool_call.arguments | tojson }}", "", "hermes"),
    ("<tool_call>\n<function={{ name }}>", "", "qwen3_coder"),
    ("<tool_call>{{ name }}<arg_key>{{ k }}</arg_key>", "", "glm47"),
    ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>", "", "deepseekv3"),
    ("<|tool_calls_section_begin|>", "", "kimi_k2"),
    ("[TOOL_CALLS]", "", "mistral"),
    ("<|python_tag|>", "", "llama3_json"),
    ("", "deepseek_v32", "deepseekv32"),  # V3.2 ships a Python encoder, no Jinja template: xLLM's model_type table
    ("", "glm_moe_dsa", "glm5"),
])
def test_auto_tool_parser(template, model_type, expected):
    assert ParserRegistry().tool_parser("auto", model_type, template).name == expected


def test_refusals_name_the_flag():
    registry = ParserRegistry()
    with pytest.raises(ConfigError, match="--tool_call_parser: unknown parser 'nope'"):
        registry.tool_parser("nope", "", "")
    with pytest.raises(ConfigError, match="--tool_call_parser auto"):
        registry.tool_parser("auto", "llama", "{{ messages }}")
    with pytest.raises(ConfigError, match="--reasoning_parser auto"):
        registry.reasoning_parser("auto", "{{ messages }}")
    assert registry.reasoning_parser("auto", "{% if '</think>' in content %}").name in BUILTIN_REASONING_PARSERS
    with pytest.raises(ConfigError, match="--reasoning_parser: unknown"):
        registry.reasoning_parser("deepseek_r1", "")


PLUGIN = '''
from heterollm.parsers.tool_formats import DelimitedFormat, HermesFormat
from heterollm.plugins import hookimpl


class Angle(DelimitedFormat):
    start, end = "<<", ">>"
    parse_block = HermesFormat.parse_block


@hookimpl
def heterollm_register_parsers(registry):
    registry.register_tool_parser("angle", Angle, "angle.py")
'''


def test_tool_parser_plugin_file_registers_through_the_hook(tmp_path: Path):
    (tmp_path / "angle.py").write_text(PLUGIN)
    registry = build_registry(make_plugin_manager(), str(tmp_path / "angle.py"))
    parser = registry.tool_parser("angle", "", "")
    text = 'Hi <<{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}>>'
    parsed = ChoiceParser(tools_parser=parser, tools=TOOLS).result(text)
    assert parsed.content == "Hi " and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [PARIS]


def test_plugin_file_errors_name_the_flag(tmp_path: Path):
    (tmp_path / "empty.py").write_text("x = 1\n")
    with pytest.raises(ConfigError, match="--tool_parser_plugin: .* defines no `heterollm_register_parsers`"):
        build_registry(make_plugin_manager(), str(tmp_path / "empty.py"))
    with pytest.raises(ConfigError, match="--tool_parser_plugin: .* is not a file"):
        build_registry(make_plugin_manager(), str(tmp_path / "missing.py"))


def test_a_taken_name_is_refused_with_both_origins():
    class Dup:
        @pluggy.HookimplMarker("heterollm")
        def heterollm_register_parsers(self, registry):
            registry.register_tool_parser("hermes", BUILTIN_TOOL_PARSERS["mistral"], "dup-plugin 1.0")

    pm = make_plugin_manager()
    pm.register(Dup())
    with pytest.raises(ConfigError, match="dup-plugin 1.0 registers 'hermes', which heterollm already names"):
        build_registry(pm)


def test_the_example_parser_plugin_in_plugins():
    """plugins/example_tool_parser, loaded as --tool_parser_plugin loads a file."""
    root = Path(__file__).resolve().parents[2]
    plugin = root / "plugins/example_tool_parser/heterollm_example_tool_parser/__init__.py"
    registry = build_registry(make_plugin_manager(), str(plugin))
    parser = registry.tool_parser("llama3_function_tag", "", "")
    assert registry.tool[parser.name][1] == "heterollm-example-tool-parser"
    text = 'On it. <function=get_weather>{"city": "Paris", "days": 3}</function>'
    p = ChoiceParser(tools_parser=parser, tools=TOOLS)
    parsed = p.result(text)
    assert parsed.content == "On it. " and [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [PARIS]
    streamed = pieces_result(ChoiceParser(tools_parser=parser, tools=TOOLS), list(text))
    assert streamed == (None, "On it. ", [PARIS])
