"""JSON numbers are bounded in length (jaxkv/structured_outputs/json_schema.py): at most 16
digits before the point and 10 after, no exponent, in typed numbers and in values a schema
leaves free; the bound never widens a schema and respects the schema's own bounds."""

import json
import re

import jsonschema
import pytest

from jaxkv import SamplingParams, StructuredOutputsParams
from jaxkv.structured_outputs.json_schema import MAX_FRACTION_DIGITS, MAX_INTEGER_DIGITS

NUMBERS = {"type": "object", "properties": {"x": {"type": "number"}, "n": {"type": "integer"}},
           "required": ["x", "n"]}


@pytest.fixture(scope="module")
def ll_tokenizer(smollm2_hf_tokenizer):
    import llguidance.hf
    return llguidance.hf.from_tokenizer(smollm2_hf_tokenizer, n_vocab=len(smollm2_hf_tokenizer))


def matcher(ll_tokenizer, so):
    import llguidance
    m = llguidance.LLMatcher(ll_tokenizer, so.validate(ll_tokenizer))
    assert not m.is_error(), m.get_error()
    return m


def accepts(ll_tokenizer, tok, so, text) -> bool:
    m = matcher(ll_tokenizer, so)
    ids = tok.encode(text, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids) and m.consume_tokens(ids) and m.is_accepting()


def allowed_after(ll_tokenizer, tok, so, text) -> set:
    """The one-character texts (digits, '.', 'e', '}') the grammar allows after `text`."""
    m = matcher(ll_tokenizer, so)
    assert m.consume_tokens(tok.encode(text, add_special_tokens=False)), text
    ok = set()
    for ch in "0123456789.e}":
        (tid,) = tok.encode(ch, add_special_tokens=False)
        if m.validate_tokens([tid]) == 1:
            ok.add(ch)
    return ok


def test_a_number_cannot_run_on_past_the_bound(ll_tokenizer, smollm2_hf_tokenizer):
    """The mask itself: after the last allowed digit only the end of the number is allowed;
    the unbounded rule (what llguidance compiles without the rewrite) would take more."""
    tok, so = smollm2_hf_tokenizer, StructuredOutputsParams(json=NUMBERS)
    fraction = '{"x": 1.' + "1" * MAX_FRACTION_DIGITS
    assert allowed_after(ll_tokenizer, tok, so, fraction[:-1]) >= set("0123456789")
    assert not allowed_after(ll_tokenizer, tok, so, fraction) & set("0123456789e.")
    integer = '{"x": 1, "n": ' + "9" * MAX_INTEGER_DIGITS
    assert allowed_after(ll_tokenizer, tok, so, integer[:-1]) >= set("0123456789")
    assert allowed_after(ll_tokenizer, tok, so, integer) == {"}"}
    assert not allowed_after(ll_tokenizer, tok, so, '{"x": ' + "9" * MAX_INTEGER_DIGITS) & set("0123456789")

    import llguidance
    raw = llguidance.LLMatcher(ll_tokenizer, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(NUMBERS)))
    long = '{"x": 1.' + "1" * 30 + ', "n": ' + "9" * 30 + "}"
    assert raw.consume_tokens(tok.encode(long, add_special_tokens=False)) and raw.is_accepting()
    assert not accepts(ll_tokenizer, tok, so, long)


P = StructuredOutputsParams
FREE = {"type": "object", "properties": {"d": {"type": "object"}, "l": {"type": "array"}, "e": {}}}
CASES = [  # (constraint, text, accepted)
    (P(json=NUMBERS), '{"x": -1234567890123456.0123456789, "n": -9999999999999999}', True),
    (P(json=NUMBERS), '{"x": 1e5, "n": 1}', False),  # no exponent
    (P(json=FREE), '{"d": {"a": [1, 2.5, null, "s", {"b": true}]}, "l": [3], "e": [4.5]}', True),
    (P(json=FREE), '{"d": {"a": 1.12345678901}}', False),
    (P(json=FREE), '{"l": [12345678901234567]}', False),
    (P(json=FREE), '{"e": 0.12345678901}', False),
    (P(json=FREE, disable_additional_properties=False), '{"zz": 0.12345678901}', False),
    (P(json=FREE, disable_additional_properties=False), '{"zz": 0.1234567890}', True),
    (P(json_object=True), '{"a": {"b": [1.5, -2, "x"]}}', True),
    (P(json_object=True), '{"a": {"b": [1.55555555555555555]}}', False),
    (P(json=True), "[12345678901234567]", False),
    (P(json={"type": "number", "minimum": 1e17, "maximum": 1e18}), "100000000000000000", True),
    (P(json={"type": "number", "minimum": 1e15}), "10000000000000000", False),
    (P(json={"type": "number", "multipleOf": 0.25}), "2.75", True),
    (P(json={"type": "number", "const": 1e20}), "100000000000000000000", True),
    (P(json={"$id": "urn:x", "type": "object", "properties": {"a": {"type": "number"}}}),
     '{"a": 1.12345678901}', False),
    # Free values as pydantic and older drafts write them: annotations only, untyped bounds,
    # draft 4's tuple items.
    (P(json={"type": "object", "properties": {"p": {"title": "Payload"}}}), '{"p": 1.12345678901}', False),
    (P(json={"type": "object", "properties": {"p": {"title": "Payload"}}}), '{"p": [1, "a"]}', True),
    (P(json={"type": "object", "properties": {"m": {"minimum": 0}}}), '{"m": 1.12345678901}', False),
    (P(json={"type": "object", "properties": {"m": {"minimum": 0}}}), '{"m": "text"}', True),
    (P(json={"type": "array", "items": [{"type": "number"}]}), "[1.12345678901]", False),
    # Bounds that would clash with the schema's own are not added (or the schema compiles
    # unbounded): allOf branches, a $ref beside a bound, a range finer than 1e-10.
    (P(json={"type": "object", "required": ["x"], "properties": {"x": {"allOf": [
        {"type": "number"}, {"minimum": 1e17}]}}}), '{"x": 100000000000000000}', True),
    (P(json={"$defs": {"n": {"type": "number"}}, "type": "object", "properties": {
        "x": {"$ref": "#/$defs/n", "minimum": 1e17}}}), '{"x": 100000000000000000}', True),
    (P(json={"$defs": {"n": {"type": "number"}}, "type": "object", "properties": {
        "x": {"$ref": "#/$defs/n"}}}), '{"x": 1.12345678901}', False),
    (P(json={"type": "number", "minimum": 1e-12, "maximum": 2e-12}), "0.0000000000015", True),
]


@pytest.mark.parametrize("so,text,accepted", CASES)
def test_bounds_reach_free_values_and_keep_the_schemas_own(ll_tokenizer, smollm2_hf_tokenizer,
                                                            so, text, accepted):
    assert accepts(ll_tokenizer, smollm2_hf_tokenizer, so, text) == accepted
    if accepted and so.json is not None:  # what the grammar lets through, the schema takes
        jsonschema.validate(json.loads(text), so.json if isinstance(so.json, dict) else {})


def test_a_model_asked_for_endless_digits_stops_at_the_bound(llm):
    """Greedy answers that run on until max_tokens without the bound (measured: 0.0000000000000000111...
    and 1.111... to the 64-token limit) end their number at the bound and validate."""
    schema = {"type": "object", "properties": {"value": {"type": "number"}}, "required": ["value"]}
    prompts = ["What is pi to 50 decimal places? Answer as JSON.",
               "Write the number 1.1111111111111111111111111 as JSON."]
    sp = SamplingParams(temperature=0, max_tokens=64,
                        structured_outputs=StructuredOutputsParams(json=schema))
    outs = llm.chat([[{"role": "user", "content": q}] for q in prompts], sp, use_tqdm=False)
    for o in outs:
        out = o.outputs[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
        (number,) = re.findall(r"-?\d+(?:\.\d+)?", out.text)
        whole, _, frac = number.lstrip("-").partition(".")
        assert len(whole) <= MAX_INTEGER_DIGITS and len(frac) <= MAX_FRACTION_DIGITS, out.text
