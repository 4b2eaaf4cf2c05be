"""Structured output on the real default model (SmolLM2-135M-Instruct), as a user runs it: the
server's defaults (any whitespace allowed in JSON), a chat prompt per schema, greedy. Every answer
parses and validates with jsonschema; regex and choice answers match."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from heterollm import LLM, SamplingParams
from json_schemas import SCHEMAS

pytestmark = pytest.mark.slow  # the default run skips it; CI runs `-m slow` as a second step


@pytest.fixture(scope="module")
def smollm2():
    llm = LLM("smollm2", dtype="float32", num_gpu_blocks_override=256, block_size=16, guided_decoding_backend="auto")
    yield llm
    llm.shutdown()


def _chat_batch(llm, convs, params):
    tok = llm.engine.tokenizer
    ids = [tok.apply_chat_template(c, add_generation_prompt=True) for c in convs]
    return llm.generate([{"prompt_token_ids": i} for i in ids], params)


def test_twenty_schemas_on_smollm2(smollm2):
    convs = [[{"role": "user", "content": f"Reply with JSON that follows this schema: {json.dumps(s)}"}]
             for s in SCHEMAS]
    params = [SamplingParams(max_tokens=160, temperature=0, structured_outputs={"json": s}) for s in SCHEMAS]
    for schema, out in zip(SCHEMAS, _chat_batch(smollm2, convs, params)):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)


def test_regex_choice_and_json_object_on_smollm2(smollm2):
    convs = [[{"role": "user", "content": q}] for q in
             ("What is the capital of Japan? Answer with the city.", "Is the sky blue? Answer yes or no.",
              "Give Tokyo as a JSON object with two keys: name and country.", "Give a US phone number.")]
    params = [SamplingParams(max_tokens=20, temperature=0,
                             structured_outputs={"regex": r"(The capital of Japan is )?[A-Z][a-z]+\."}),
              SamplingParams(max_tokens=5, temperature=0, structured_outputs={"choice": ["Yes", "No"]}),
              SamplingParams(max_tokens=200, temperature=0, structured_outputs={"json_object": True}),
              SamplingParams(max_tokens=20, temperature=0, structured_outputs={"regex": r"\(\d{3}\) \d{3}-\d{4}"})]
    city, yes, obj, phone = [o.outputs[0] for o in _chat_batch(smollm2, convs, params)]
    assert city.text.endswith("Tokyo.")
    free = _chat_batch(smollm2, convs[1:2], [SamplingParams(max_tokens=3, temperature=0)])[0].outputs[0].text
    assert free.split()[0].strip(".,") in ("Yes", "No") and yes.text == free.split()[0].strip(".,")
    assert obj.finish_reason == "stop" and isinstance(json.loads(obj.text), dict)
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", phone.text)
