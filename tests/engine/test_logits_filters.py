"""logit_bias, allowed_token_ids and bad_words on the real model, against the model's own
logprobs (the plain run's top-20 at the same position) and its plain greedy output."""

import numpy as np
import pytest

from jaxkv import SamplingParams

PROMPT = [{"role": "user", "content": "Name three colors of the rainbow."}]


def plain(llm, n=24):
    return llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=n, logprobs=20), use_tqdm=False)[0].outputs[0]


def test_logit_bias_moves_the_argmax_as_the_logits_say(llm):
    ref = plain(llm)
    first = ref.logprobs[0]
    ranked = sorted(first, key=lambda t: -first[t].logprob)
    second = ranked[1]
    gap = first[ranked[0]].logprob - first[second].logprob
    # A bias just above the gap makes the runner-up win; just below, it does not.
    for bias, want in ((gap + 0.05, second), (gap - 0.05, ranked[0])):
        out = llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=1, logit_bias={second: bias}),
                       use_tqdm=False)[0].outputs[0]
        assert out.token_ids == [want], (bias, gap)
    out = llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=6, logit_bias={"198": 100}),
                   use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [198] * 6  # "\n" every time
    out = llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=1, logit_bias={ranked[0]: -100}),
                   use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [second]


def test_allowed_token_ids_pick_the_best_allowed(llm):
    ref = plain(llm)
    first = ref.logprobs[0]
    ranked = sorted(first, key=lambda t: -first[t].logprob)
    allowed = [ranked[5], ranked[3], ranked[9]]
    out = llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed),
                   use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [ranked[3]]
    outs = llm.chat(PROMPT, SamplingParams(temperature=1.0, seed=3, max_tokens=12, n=4,
                                           allowed_token_ids=allowed), use_tqdm=False)[0].outputs
    assert all(set(o.token_ids) <= set(allowed) for o in outs)
    assert len({t for o in outs for t in o.token_ids}) > 1  # sampling among them, not argmax


def test_bad_words_never_appear_and_change_nothing_before(llm):
    """vLLM's rule: a word is banned as tokenized alone and, when that gives as many tokens with
    another first token, with a leading space. The word is taken from the plain output, one
    whose spaced form the rule covers; the output is the plain one up to where it started."""
    from jaxkv.engine.llm_engine import bad_words_token_ids
    ref = plain(llm, 32)
    tok = llm.get_tokenizer()
    words = [w.strip(".,:;!") for w in ref.text.split()[1:]]
    word = next(w for w in words if len(w) > 3 and len(bad_words_token_ids(tok, [w])) == 2)
    seqs = bad_words_token_ids(tok, [word])
    out = llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=32, bad_words=[word]),
                   use_tqdm=False)[0].outputs[0]
    assert f" {word}" not in out.text
    ids = out.token_ids
    for s in seqs:
        assert not any(ids[i:i + len(s)] == s for i in range(len(ids)))
    cut = next(i for i in range(len(ids)) if ids[i] != ref.token_ids[i])
    assert ref.token_ids[:cut] == ids[:cut]  # identical until the banned word would end
    assert any(ref.token_ids[cut - len(s) + 1:cut + 1] == s for s in seqs)


@pytest.mark.parametrize("kwargs, field", [
    (dict(logit_bias={49152: 1.0}), "logit_bias"), (dict(allowed_token_ids=[5, 10**6]), "allowed_token_ids"),
])
def test_ids_outside_the_vocabulary_name_the_field(llm, kwargs, field):
    with pytest.raises(ValueError, match=f"{field}: token id .* outside the vocabulary"):
        llm.generate("hi", SamplingParams(**kwargs), use_tqdm=False)
    s = llm.stats()
    assert s.num_running == s.num_waiting == 0


def test_penalties_and_filters_together_match_numpy(llm):
    """One step with repetition penalty, logit_bias and allowed_token_ids: the token equals
    numpy's argmax over the plain run's top-20 logprobs with vLLM's order applied."""
    ref = plain(llm, 1)
    lp = ref.logprobs[0]
    ranked = sorted(lp, key=lambda t: -lp[t].logprob)
    allowed = ranked[:6]
    bias = {ranked[4]: 0.3, ranked[1]: -0.2}
    got = llm.chat(PROMPT, SamplingParams(temperature=0, max_tokens=1, allowed_token_ids=allowed,
                                          logit_bias=bias), use_tqdm=False)[0].outputs[0].token_ids[0]
    scores = {t: lp[t].logprob + bias.get(t, 0.0) for t in allowed}  # log-softmax shift is common
    assert got == max(scores, key=scores.get)
    assert np.isfinite(list(scores.values())).all()


def test_bad_words_that_cannot_be_encoded_name_the_field(llm):
    for words in (["\ud800"], ["\u200b"]):  # a lone surrogate; a word of no tokens (if so)
        try:
            llm.generate("hi", SamplingParams(bad_words=words, max_tokens=2), use_tqdm=False)
        except ValueError as e:
            assert str(e).startswith("bad_words")
        else:
            assert words == ["\u200b"]  # it encodes to tokens: accepted
    s = llm.stats()
    assert s.num_running == s.num_waiting == 0
