"""One set of rules for both doors: every row of TABLE (a SamplingParams field, a bad value, a
word of the message) is refused by the Python API (ValueError naming the field, in
SamplingParams or at LLM.generate) and by the server (400 whose param is the field), and every
row of GOOD is taken by both. Types are not coerced on either door: "5", true and 2.0 are not
ints, "0.5" is not a number. JSON null means "unset" on the server (OpenAI's clients send it),
so None is not in the table."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from tests.serve.conftest import MODEL

TABLE = [  # field, bad value, a word the Python message holds
    ("n", 0, "[1, 16]"), ("n", 17, "[1, 16]"), ("n", "2", "int"), ("n", True, "int"), ("n", 2.0, "int"),
    ("temperature", -1, ">= 0"), ("temperature", "0.5", "number"), ("temperature", True, "number"),
    ("top_p", 0, "(0, 1]"), ("top_p", 1.5, "(0, 1]"), ("top_p", "1", "number"),
    ("top_k", -2, "-1"), ("top_k", 1.5, "int"), ("top_k", "5", "int"),
    ("min_p", 2, "[0, 1]"), ("min_p", "0.1", "number"),
    ("repetition_penalty", 0, "> 0"), ("repetition_penalty", "1", "number"),
    ("presence_penalty", 3, "[-2, 2]"), ("frequency_penalty", -3, "[-2, 2]"),
    ("frequency_penalty", False, "number"),
    ("seed", 1.5, "int"), ("seed", "7", "int"), ("seed", True, "int"), ("seed", 2**70, "64 bits"),
    ("stop", 5, "str"), ("stop", [""], "empty"), ("stop", ["a", 1], "strings"),
    ("stop_token_ids", [-1], ">= 0"), ("stop_token_ids", ["a"], "int"), ("stop_token_ids", [1.0], "int"),
    ("stop_token_ids", [10**9], "vocabulary"),
    ("max_tokens", 0, ">= 1"), ("max_tokens", 1.5, "int"), ("max_tokens", "8", "int"),
    ("min_tokens", -1, ">= 0"), ("min_tokens", 99, "max_tokens"), ("min_tokens", True, "int"),
    ("logprobs", -1, ">= 0"), ("logprobs", 21, "max_logprobs"), ("logprobs", "1", "int"),
    ("allowed_token_ids", [], "non-empty"), ("allowed_token_ids", [-1], ">= 0"),
    ("allowed_token_ids", [1.5], "int"), ("allowed_token_ids", [10**9], "vocabulary"),
    ("bad_words", [""], "non-empty"), ("bad_words", "x", "list"),
    ("logit_bias", {"a": 1}, "token ids"), ("logit_bias", {"-1": 1}, "token ids"),
    ("logit_bias", {"1": "x"}, "number"), ("logit_bias", {"999999": 1}, "vocabulary"),
    ("ignore_eos", "yes", "bool"), ("ignore_eos", 1, "bool"), ("skip_special_tokens", "no", "bool"),
    ("include_stop_str_in_output", 2, "bool"), ("spaces_between_special_tokens", 1.0, "bool"),
]
GOOD = [("n", 2), ("temperature", 0), ("temperature", 0.7), ("top_p", 1), ("top_k", -1),
        ("top_k", 5), ("min_p", 0.1), ("seed", -1), ("stop", "x"), ("stop_token_ids", [2]),
        ("max_tokens", 4), ("logprobs", 2), ("allowed_token_ids", [2, 3]), ("bad_words", ["zz"]),
        ("logit_bias", {"5": -100}), ("ignore_eos", True), ("presence_penalty", -2)]


def _python(llm, field, value):
    """The Python door: SamplingParams, then LLM.generate (the engine's checks against the
    model: vocabulary, max_logprobs). Returns the ValueError, or None when it was taken."""
    kw = {"max_tokens": 4, field: value} if field != "max_tokens" else {field: value}
    try:
        llm.generate(["Hi"], SamplingParams(**kw), use_tqdm=False)
    except ValueError as e:
        return e
    return None


def _server(server, field, value):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, field: value}
    return server.post("/v1/completions", body)


@pytest.mark.parametrize("field,value,word", TABLE, ids=[f"{f}={v!r}" for f, v, _ in TABLE])
def test_both_doors_refuse(llm, server, field, value, word):
    err = _python(llm, field, value)
    assert err is not None and str(err).startswith(field) and word in str(err), err
    r = _server(server, field, value)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field, r.json()


@pytest.mark.parametrize("field,value", GOOD, ids=[f"{f}={v!r}" for f, v in GOOD])
def test_both_doors_take(llm, server, field, value):
    assert _python(llm, field, value) is None
    r = _server(server, field, value)
    assert r.status_code == 200, r.text
