"""Structured outputs through the Python API (llguidance matchers, the sampler's bitmask):
JSON schemas, regex, choice, grammars; composition with sampling features; bad input."""

import json
import pathlib
import re

import jsonschema
import numpy as np
import pytest

from jaxkv import SamplingParams, StructuredOutputsParams
from tests.helpers import assert_same_or_near_tie, margins_from_logprobs

SCHEMAS = json.loads((pathlib.Path(__file__).parents[1] / "data" / "json_schemas.json").read_text())


def chat(prompt):
    return [{"role": "user", "content": prompt}]


def check_json(out, schema):
    """Valid against `schema`, or cut by max_tokens. Returns True when valid."""
    c = out.outputs[0]
    if c.finish_reason == "length":
        return False
    assert c.finish_reason == "stop", c.finish_reason
    jsonschema.validate(json.loads(c.text), schema)
    return True


def test_forty_schemas_greedy_and_sampled_validate(llm):
    """Every output parses and validates, unless max_tokens cut it; nothing compiles."""
    n0 = llm.stats().num_compilations
    params = [SamplingParams(temperature=0, max_tokens=128,
                             structured_outputs=StructuredOutputsParams(json=s["schema"]))
              for s in SCHEMAS]
    params += [SamplingParams(temperature=0.8, seed=i, max_tokens=128, structured_outputs=
                              StructuredOutputsParams(json=json.dumps(s["schema"])))
               for i, s in enumerate(SCHEMAS)]
    outs = llm.chat([chat(s["prompt"]) for s in SCHEMAS] * 2, params, use_tqdm=False)
    valid = [check_json(o, s["schema"]) for o, s in zip(outs, SCHEMAS * 2)]
    assert sum(valid) >= 40, f"only {sum(valid)} of 80 finished within max_tokens"
    assert llm.stats().num_compilations == n0
    s = llm.stats()
    assert s.num_free_blocks == s.num_total_blocks


def test_no_additional_properties_keeps_to_the_schema(llm):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"]}
    so = StructuredOutputsParams(json=schema, disable_additional_properties=True,
                                 disable_any_whitespace=True)
    out = llm.chat([chat("Describe a person as JSON with many fields.")],
                   SamplingParams(temperature=0, max_tokens=64, structured_outputs=so), use_tqdm=False)[0]
    assert check_json(out, {**schema, "additionalProperties": False})
    assert set(json.loads(out.outputs[0].text)) == {"name", "age"}
    obj = json.loads(out.outputs[0].text)  # no whitespace between JSON tokens
    assert out.outputs[0].text == json.dumps(obj, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("so,check", [
    (dict(regex=r"[0-9]{3}-[0-9]{4}"), lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    (dict(choice=["positive", "negative", "neutral"]), lambda t: t in ("positive", "negative", "neutral")),
    (dict(grammar='start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]?/'),
     lambda t: re.fullmatch(r"The answer is [1-9][0-9]?\.", t)),
    (dict(grammar='root ::= "yes" | "no"'), lambda t: t in ("yes", "no")),  # GBNF
    (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_and_json_object_match(llm, so, check):
    prompts = [chat("Give a phone number."), chat("Sentiment of 'I love it'?"), chat("What is 6 times 7?")]
    params = [SamplingParams(temperature=t, seed=3, max_tokens=48, structured_outputs=StructuredOutputsParams(**so))
              for t in (0.0, 1.0, 1.5)]
    for o in llm.chat(prompts, params, use_tqdm=False):
        if "json_object" in so and o.outputs[0].finish_reason == "length":
            continue  # any object may run on past max_tokens (the first, greedy, does not)
        assert o.outputs[0].finish_reason == "stop", o.outputs[0]
        assert check(o.outputs[0].text), o.outputs[0].text


def test_free_requests_are_unchanged_by_constrained_neighbours(llm):
    free = [chat(p) for p in ("Tell me about the sea.", "Write a haiku.", "What is JAX?")]
    fp = SamplingParams(temperature=0, max_tokens=24, logprobs=2)
    sp = SamplingParams(temperature=0.7, seed=5, max_tokens=24)
    alone = llm.chat(free + free, [fp] * 3 + [sp] * 3, use_tqdm=False)
    so = StructuredOutputsParams(json=SCHEMAS[0]["schema"])
    mixed = llm.chat(free + free + [chat("A person as JSON")] * 3,
                     [fp] * 3 + [sp] * 3 + [SamplingParams(temperature=0, max_tokens=24, structured_outputs=so)] * 3,
                     use_tqdm=False)
    for a, b in zip(mixed[:3], alone[:3]):
        assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                margins_from_logprobs(b.outputs[0].logprobs), what="free greedy")
    for a, b in zip(mixed[3:6], alone[3:6]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids  # seeded: own rows only


def test_composes_with_n_penalties_logprobs_and_stop_strings(llm):
    so = StructuredOutputsParams(json={"type": "object", "properties": {
        "words": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
        "required": ["words"]})
    p = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=80, logprobs=2, repetition_penalty=1.3,
                       presence_penalty=0.5, structured_outputs=so)
    out = llm.chat([chat("List some words as JSON.")], p, use_tqdm=False)[0]
    assert len(out.outputs) == 3
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        assert all(np.isfinite(lp.logprob) for d in c.logprobs for lp in d.values())
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), so.json)
    # A stop string inside the grammar ends the request there.
    p = SamplingParams(temperature=0, max_tokens=60, stop=[","],
                       structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]["schema"]))
    c = llm.chat([chat("A person as JSON")], p, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "," and "," not in c.text
    assert c.text.startswith("{")


def test_matches_the_grammar_token_by_token(llm):
    """The output's tokens are exactly those llguidance accepts, and EOS comes where the
    grammar may end (checked with a fresh matcher)."""
    import llguidance

    mgr = llm.llm_engine.structured_output_manager
    so = StructuredOutputsParams(regex=r"(ab|cd){2,4}")
    outs = llm.generate(["Letters:"] * 4, [SamplingParams(temperature=1.0, seed=s, max_tokens=20,
                                                          structured_outputs=so) for s in range(4)],
                        use_tqdm=False)
    for o in outs:
        m = llguidance.LLMatcher(mgr.ll_tokenizer, mgr.grammar(so))
        ids = list(o.outputs[0].token_ids)
        assert ids[-1] in llm.llm_engine.eos_token_ids
        assert m.consume_tokens(ids[:-1]) and m.is_accepting()
        assert re.fullmatch(r"(ab|cd){2,4}", o.outputs[0].text)


@pytest.mark.parametrize("so,field", [
    (dict(json={"type": "object", "properties": {"a": {"type": "nonsense"}}}), "structured_outputs.json"),
    (dict(regex="a(b"), "structured_outputs.regex"),
    (dict(grammar="start: undefined_rule"), "structured_outputs.grammar"),
    (dict(json='{"type": '), "structured_outputs.json"),
])
def test_bad_constraints_name_the_field_and_queue_nothing(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**so)), use_tqdm=False)
    s = llm.stats()
    assert s.num_waiting == 0 and s.num_running == 0


def test_params_check_one_constraint_and_its_type():
    with pytest.raises(ValueError, match="exactly one.*2 are \\(json, regex\\)"):
        StructuredOutputsParams(json={}, regex="a")
    with pytest.raises(ValueError, match="none is set"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="structured_outputs.choice"):
        StructuredOutputsParams(choice="ab")
    with pytest.raises(ValueError, match="unknown field 'jsn'"):
        SamplingParams(structured_outputs={"jsn": {}})
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs.kind == "choice"


def test_stats_count_constrained_samples_and_their_grammars(llm):
    before = llm.stats()
    so = StructuredOutputsParams(choice=["up", "down"])
    llm.generate(["Direction:"], SamplingParams(n=2, seed=0, max_tokens=4, structured_outputs=so),
                 use_tqdm=False)
    after = llm.stats()
    assert after.num_structured_output_requests == before.num_structured_output_requests + 2
    assert after.num_grammars_compiled == before.num_grammars_compiled + 2
    assert after.grammar_compile_seconds > before.grammar_compile_seconds


def test_structured_outputs_config_flag():
    from jaxkv import EngineArgs
    from jaxkv.structured_outputs.params import StructuredOutputsConfig

    for bad, key in (({"backend": "xgrammar"}, "backend"), ({"disable_any_whitespace": 1}, "disable_any_whitespace"),
                     ({"strict": True}, "strict"), ("{", "structured_outputs_config")):
        with pytest.raises(ValueError, match=re.escape(f"structured_outputs_config.{key}"
                                                       if key != "structured_outputs_config" else key)):
            EngineArgs(structured_outputs_config=bad)
    cfg = StructuredOutputsConfig.from_value('{"backend": "guidance", "disable_any_whitespace": true}')
    got = cfg.apply(StructuredOutputsParams(json={"type": "object"}))
    assert got.disable_any_whitespace and got.disable_additional_properties  # vLLM's default
    opened = cfg.apply(StructuredOutputsParams(json={"type": "object"}, disable_additional_properties=False))
    assert opened.disable_additional_properties is False  # a request may keep objects open
    off = StructuredOutputsConfig.from_value('{"disable_additional_properties": false}')
    assert off.apply(StructuredOutputsParams(json={"type": "object"})).disable_additional_properties is False


@pytest.mark.parametrize("so,field", [
    (dict(json={"enum": {"a", "b"}}), "structured_outputs.json"),  # a set is not JSON
    (dict(json={"type": "object"}, whitespace_pattern="("), "structured_outputs.whitespace_pattern"),
])
def test_more_bad_constraints_name_their_field(llm, so, field):
    with pytest.raises(ValueError, match=re.escape(field)):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputsParams(**so)), use_tqdm=False)
    with pytest.raises(ValueError, match="structural_tag: not supported"):
        StructuredOutputsParams.from_dict({"structural_tag": "{}"})
    assert StructuredOutputsParams.from_dict({"regex": "a", "disable_fallback": True}).regex == "a"


@pytest.mark.parametrize("so,extra", [
    (dict(regex="a{1000000}"), {}),  # llguidance gives up on the lexer: the grammar refuses
    (dict(choice=["yes", "no"]), {"min_tokens": 5}),  # the ban leaves no token it allows
    (dict(choice=["yes", "no"]), {"allowed_token_ids": [5, 6, 7]}),
])
def test_a_token_the_grammar_refuses_ends_the_request_with_an_error(llm, so, extra):
    """Never a "stop" on output that breaks the grammar (vLLM ends such a request too)."""
    out = llm.generate(["Answer:"], SamplingParams(temperature=0, max_tokens=8, **extra,
                                                   structured_outputs=StructuredOutputsParams(**so)),
                       use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "error", out
    s = llm.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0


def test_no_additional_properties_leaves_anyof_objects_satisfiable(llm):
    """The flag closes objects that declare properties, not an object whose keys come from
    its anyOf branches (tool_choice required's schema has that shape)."""
    schema = {"type": "array", "minItems": 1, "maxItems": 1, "items": {"type": "object", "anyOf": [
        {"properties": {"name": {"enum": ["get_weather"]},
                        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                                       "required": ["city"]}},
         "required": ["name", "parameters"]}]}}
    so = StructuredOutputsParams(json=schema, disable_additional_properties=True, disable_any_whitespace=True)
    out = llm.chat([chat("Weather in Paris? Call the tool.")],
                   SamplingParams(temperature=0, max_tokens=64, structured_outputs=so), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "stop", out.outputs[0]
    (call,) = json.loads(out.outputs[0].text)
    assert set(call) == {"name", "parameters"} and set(call["parameters"]) == {"city"}


def test_unset_additional_properties_are_closed_by_default(llm):
    """As vLLM's default backend: an object schema that declares properties and says nothing of
    additionalProperties takes no other key, unless the request keeps it open; a schema that
    says additionalProperties true stays open."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0}},
              "required": ["name", "age"]}
    sp = lambda so: SamplingParams(temperature=0, max_tokens=64, structured_outputs=so)
    prompt = [chat("Describe a person as JSON with many fields.")]
    out = llm.chat(prompt, sp(StructuredOutputsParams(json=schema)), use_tqdm=False)[0]
    assert set(json.loads(out.outputs[0].text)) == {"name", "age"}
    mgr = llm.llm_engine.structured_output_manager
    tok = llm.get_tokenizer()

    def accepts(dap, text, sch=schema):
        import llguidance
        grammar = mgr.grammar(StructuredOutputsParams(json=sch, disable_additional_properties=dap))
        m = llguidance.LLMatcher(mgr.ll_tokenizer, grammar)
        return bool(m.consume_tokens(tok.encode(text, add_special_tokens=False))) and not m.is_error()

    extra = '{"name": "a", "age": 1, "x": 2}'
    assert accepts(True, '{"name": "a", "age": 1}') and not accepts(True, extra)
    assert accepts(False, extra)  # the request kept it open
    assert accepts(True, extra, {**schema, "additionalProperties": True})  # the schema did
