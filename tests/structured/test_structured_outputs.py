"""Structured outputs on the bundled model: constrained completions parse and validate against several schemas
(nested objects, enums, arrays), regexes match in full, choices are one of the choices, bad grammars are the
request's error, and a constrained row leaves the unconstrained rows of its batch alone."""

from __future__ import annotations

import json
import re

import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from moekv import LLM, SamplingParams  # noqa: E402
from moekv.errors import InvalidRequestError  # noqa: E402
from moekv.paths import default_model_dir  # noqa: E402
from moekv.sampling import StructuredOutputParams  # noqa: E402
from moekv.structured.backend import vocab_metadata  # noqa: E402
from moekv.testing.structured_cases import REGEXES, SCHEMAS  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    return LLM(model=str(default_model_dir()))


def constrained(seed: int, max_tokens: int = 160, **spec) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed,
                          structured_outputs=StructuredOutputParams(**spec))


def test_unconstrained_model_does_not_write_json(llm):
    out = llm.generate(["ROMEO:"], SamplingParams(max_tokens=40, temperature=0.8, seed=0))[0].outputs[0]
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(llm, name):
    schema = SCHEMAS[name]
    outs = llm.generate(["ROMEO:", "JULIET:\nO", "First Citizen:"],
                        [constrained(seed, json=schema) for seed in range(3)])
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), schema)


def test_json_object_regex_and_choice(llm):
    outs = llm.generate(["ROMEO:"] * 4, [
        constrained(1, json_object=True, max_tokens=60),
        constrained(2, regex=REGEXES["date"]),
        constrained(3, regex=REGEXES["name_and_number"]),
        constrained(4, choice=["Montague", "Capulet", "neither"]),
    ])
    obj, date, name, choice = (o.outputs[0] for o in outs)
    if obj.finish_reason == "stop":
        assert isinstance(json.loads(obj.text), dict)
    else:                                        # a string still open at max_tokens: still an object's prefix
        assert obj.text.startswith("{")
    assert re.fullmatch(REGEXES["date"], date.text) and date.finish_reason == "stop"
    assert re.fullmatch(REGEXES["name_and_number"], name.text)
    assert choice.text in ("Montague", "Capulet", "neither") and choice.finish_reason == "stop"


def test_constrained_rows_leave_the_others_alone(llm):
    plain = SamplingParams(max_tokens=12, temperature=0)
    alone = llm.generate(["JULIET:", "ROMEO:"], plain)
    mixed = llm.generate(["JULIET:", "ROMEO:", "ROMEO:"], [plain, plain, constrained(0, json=SCHEMAS["person"])])
    assert [o.outputs[0].token_ids for o in mixed[:2]] == [o.outputs[0].token_ids for o in alone]
    jsonschema.validate(json.loads(mixed[2].outputs[0].text), SCHEMAS["person"])


def test_bad_grammar_is_the_requests_error(llm):
    with pytest.raises(InvalidRequestError) as info:
        llm.generate(["a", "b"], [SamplingParams(), constrained(0, regex="([a-z")])
    assert info.value.param == "structured_outputs"
    with pytest.raises(InvalidRequestError):
        StructuredOutputParams(json={"type": "object"}, regex="a")
    assert llm.engine.requests == {}


def test_vocab_metadata_from_tokenizer_json():
    assert vocab_metadata({"decoder": {"type": "ByteLevel"}}) == ("byte_level", False)
    spm = {"model": {"type": "BPE", "byte_fallback": True},
           "decoder": {"type": "Sequence", "decoders": [{"type": "Replace"}, {"type": "ByteFallback"}]},
           "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}]}}
    assert vocab_metadata(spm) == ("byte_fallback", True)
    assert vocab_metadata({"decoder": {"type": "WordPiece"}}) == ("raw", False)
