"""SamplingParams: vLLM's defaults, normalisation, and ValueError naming the field."""

import dataclasses

import pytest

from jaxkv.sampling.params import RequestOutputKind, SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    expected = dict(
        n=1, temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
        presence_penalty=0.0, frequency_penalty=0.0, seed=None, stop=[], stop_token_ids=[],
        ignore_eos=False, min_tokens=0, max_tokens=16, logprobs=None, prompt_logprobs=None,
        skip_special_tokens=True, include_stop_str_in_output=False,
        output_kind=RequestOutputKind.CUMULATIVE, logit_bias=None, allowed_token_ids=None,
        bad_words=None, spaces_between_special_tokens=True, structured_outputs=None,
    )
    assert {f.name: getattr(p, f.name) for f in dataclasses.fields(p)} == expected
    assert not p.is_greedy


def test_request_output_kind_values():
    assert [(k.name, k.value) for k in RequestOutputKind] == [
        ("CUMULATIVE", 0), ("DELTA", 1), ("FINAL_ONLY", 2)]


def test_normalisation():
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]
    assert SamplingParams(stop_token_ids=(2, 7)).stop_token_ids == [2, 7]
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5
    assert SamplingParams(max_tokens=None).max_tokens is None
    assert SamplingParams(temperature=1).temperature == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)


@pytest.mark.parametrize("temperature, greedy", [(0.0, True), (1e-6, True), (1e-5, False), (0.7, False)])
def test_is_greedy(temperature, greedy):
    assert SamplingParams(temperature=temperature).is_greedy is greedy


def test_valid_edges_accepted():
    SamplingParams(temperature=0.0, top_p=1.0, top_k=1, min_p=1.0, repetition_penalty=0.01,
                   presence_penalty=-2.0, frequency_penalty=2.0, n=3, max_tokens=1, min_tokens=1,
                   logprobs=0, prompt_logprobs=0, seed=0, stop=["\n"], stop_token_ids=[0])
    SamplingParams(max_tokens=None, min_tokens=1000)


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -1.0), ("temperature", "hot"), ("temperature", None),
        ("temperature", float("nan")),
        ("top_p", 0.0), ("top_p", 1.5), ("top_p", -0.1),
        ("top_k", -2), ("top_k", 2.5),
        ("min_p", -0.1), ("min_p", 1.1),
        ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5), ("presence_penalty", -2.1),
        ("frequency_penalty", 3.0), ("frequency_penalty", -3.0),
        ("n", 0), ("n", 1.5), ("n", True),
        ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0),
        ("min_tokens", -1),
        ("logprobs", -1), ("logprobs", 1.5),
        ("prompt_logprobs", -1),
        ("stop", ""), ("stop", ["ok", ""]), ("stop", 5), ("stop", ["ok", 3]),
        ("stop_token_ids", [1, -1]), ("stop_token_ids", "2"), ("stop_token_ids", [1.5]),
        ("seed", "abc"),
        ("ignore_eos", "yes"), ("skip_special_tokens", 1), ("include_stop_str_in_output", None),
        ("output_kind", 1),
    ],
)
def test_invalid_value_raises_naming_field(field, value):
    with pytest.raises(ValueError, match=field) as info:
        SamplingParams(**{field: value})
    assert "got" in str(info.value)


def test_min_tokens_above_max_tokens():
    with pytest.raises(ValueError, match="min_tokens") as info:
        SamplingParams(min_tokens=20, max_tokens=10)
    assert "max_tokens" in str(info.value) and "20" in str(info.value)


def test_message_names_field_and_value():
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1.0$"):
        SamplingParams(temperature=-1.0)


def test_clone_is_deep():
    p = SamplingParams(stop=["a"], stop_token_ids=[3], max_tokens=None)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("b")
    q.stop_token_ids.append(4)
    q.max_tokens = 100
    assert p.stop == ["a"] and p.stop_token_ids == [3] and p.max_tokens is None


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias=[1, 2]), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={"x": 1.0}), "logit_bias"), (dict(logit_bias={3: float("nan")}), "logit_bias"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"), (dict(allowed_token_ids=[1, -2]), "allowed_token_ids"),
    (dict(allowed_token_ids=[1.5]), "allowed_token_ids"), (dict(bad_words="word"), "bad_words"),
    (dict(bad_words=["ok", " "]), "bad_words"),
])
def test_logits_filters_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_logit_bias_keys_from_json():
    p = SamplingParams(logit_bias={"42": 5, 7: -1.5})
    assert p.logit_bias == {42: 5.0, 7: -1.5} and p.has_logits_filters
    assert not SamplingParams().has_logits_filters
