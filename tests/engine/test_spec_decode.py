"""Speculative decoding (n-gram drafts) on the real model: greedy outputs equal those without
speculation (HF parity prompts, copy prompts, n > 1, prefix caching, preemption), seeded
sampling gives the same tokens and logprobs, the sampled distribution is the model's
(chi-square over independent seeds), and a stop inside an accepted run ends the output at the
right token. No block leaks."""

import numpy as np
import pytest
from scipy.stats import chi2_contingency

from jaxkv import LLM, SamplingParams
from tests.conftest import TEST_ENGINE
from tests.engine.test_hf_parity import PROMPTS
from tests.helpers import assert_same_or_near_tie, margins_from_logprobs

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
PARAGRAPH = ("The committee met on Tuesday to review the budget for the new library. After a long "
             "discussion, the members agreed to increase funding for children's books and to "
             "extend opening hours on weekends. The final report will be published next month.")
COPY = [f"Copy the following paragraph, replacing 'Tuesday' with 'Friday':\n\n{PARAGRAPH}",
        f"Repeat this text word for word:\n\n{PARAGRAPH}"]


@pytest.fixture(scope="module")
def spec_llm():
    return LLM(speculative_config=SPEC, **TEST_ENGINE)


def chats(llm, texts):
    tok = llm.get_tokenizer()
    return [{"prompt_token_ids": tok.apply_chat_template([{"role": "user", "content": t}],
                                                         add_generation_prompt=True, return_dict=False)}
            for t in texts]


def idle(llm):
    s = llm.stats()
    assert s.num_free_blocks == s.num_total_blocks and s.num_running == s.num_waiting == 0


def spec_delta(llm, before):
    s = llm.stats()
    return (s.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens,
            s.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens)


def test_drafts_compile_nothing_after_warmup(llm, spec_llm):
    """Draft rows need larger sampler batches in the 256-token bucket (64 and 128 rows): those
    are compiled with the bucket at warmup, so a workload that mixes prompts and drafted
    decodes compiles nothing."""
    prompts = chats(llm, COPY + PROMPTS)
    before = spec_llm.stats()
    spec_llm.generate(prompts * 6, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)
    assert spec_delta(spec_llm, before)[1] > 100
    assert spec_llm.stats().num_compilations == before.num_compilations
    assert spec_llm.llm_engine.runner.sample_row_counts(256) == (32, 64, 128)


def test_greedy_outputs_unchanged(llm, spec_llm):
    prompts = chats(llm, PROMPTS + COPY)
    params = [SamplingParams(temperature=0, max_tokens=48, logprobs=2) for _ in prompts]
    params.append(SamplingParams(temperature=0, max_tokens=40, logprobs=2, n=2))
    prompts.append(prompts[-1])  # n = 2 of a copy prompt, after the same prompt (prefix hit)
    ref = llm.generate(prompts, params, use_tqdm=False)
    before = spec_llm.stats()
    got = spec_llm.generate(prompts, params, use_tqdm=False)
    drafted, accepted = spec_delta(spec_llm, before)
    assert drafted > 100 and 0.3 * drafted < accepted < drafted  # both paths are exercised
    for a, b in zip(got, ref):
        for x, y in zip(a.outputs, b.outputs):
            assert_same_or_near_tie(x.token_ids, y.token_ids, margins_from_logprobs(y.logprobs),
                                    what="speculative vs plain")
            if x.token_ids == y.token_ids:
                assert x.text == y.text and x.finish_reason == y.finish_reason
                np.testing.assert_allclose([d[t].logprob for d, t in zip(x.logprobs, x.token_ids)],
                                           [d[t].logprob for d, t in zip(y.logprobs, y.token_ids)],
                                           atol=2e-3)
    assert spec_llm.stats().spec_decode_acceptance_rate is not None
    idle(spec_llm)


def test_seeded_sampling_same_tokens(llm, spec_llm):
    prompts = chats(llm, COPY)
    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=s, max_tokens=40, logprobs=1,
                             repetition_penalty=1.1 if s % 2 else 1.0, min_tokens=5)
              for s in range(4)]
    pp = [prompts[i % 2] for i in range(4)]
    ref = llm.generate(pp, params, use_tqdm=False)
    before = spec_llm.stats()
    got = spec_llm.generate(pp, params, use_tqdm=False)
    assert spec_delta(spec_llm, before)[1] > 20
    for a, b in zip(got, ref):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].cumulative_logprob == pytest.approx(b.outputs[0].cumulative_logprob, abs=1e-2)
    idle(spec_llm)


def test_sampled_distribution_is_the_models(llm, spec_llm):
    """Output tokens 1-3 of a copy prompt at temperature 0.9 (token 0 comes from the prefill,
    without a draft), 240 samples each, seeds 0-239 with speculation and 1000-1239 without: a
    chi-square test of homogeneity per position (rare tokens pooled) must not reject at 0.1%."""
    prompt = chats(llm, COPY[1:])[0]
    n = 240
    with_spec = [SamplingParams(temperature=0.9, seed=s, max_tokens=4, ignore_eos=True) for s in range(n)]
    without = [SamplingParams(temperature=0.9, seed=1000 + s, max_tokens=4, ignore_eos=True) for s in range(n)]
    before = spec_llm.stats()
    a = [o.outputs[0].token_ids for o in spec_llm.generate([prompt] * n, with_spec, use_tqdm=False)]
    drafted, accepted = spec_delta(spec_llm, before)
    assert accepted > 100 and drafted - accepted > 20  # acceptance and rejection both frequent
    b = [o.outputs[0].token_ids for o in llm.generate([prompt] * n, without, use_tqdm=False)]
    for pos in (1, 2, 3):
        xa, xb = [t[pos] for t in a], [t[pos] for t in b]
        tokens = sorted(set(xa) | set(xb))
        table = np.array([[xa.count(t) for t in tokens], [xb.count(t) for t in tokens]])
        big = table.sum(0) >= 10
        table = np.column_stack([table[:, big], table[:, ~big].sum(1)])
        table = table[:, table.sum(0) > 0]
        assert table.shape[1] >= 2, f"position {pos}: too few distinct tokens to test"
        p = chi2_contingency(table).pvalue
        assert p > 1e-3, f"position {pos}: distributions differ (p={p:.2e}): {table.tolist()}"
    idle(spec_llm)


def test_stop_inside_an_accepted_run(llm, spec_llm):
    prompt = chats(llm, COPY[1:])[0]
    full = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0].outputs[0]
    words = full.text.split()
    cases = [SamplingParams(temperature=0, max_tokens=48, stop=[w]) for w in words[3:12]]
    cases += [SamplingParams(temperature=0, max_tokens=48, stop_token_ids=[t]) for t in full.token_ids[4:12]]
    cases += [SamplingParams(temperature=0, max_tokens=m) for m in (2, 5, 7, 11)]
    cases += [SamplingParams(temperature=0, max_tokens=48, stop=[words[6]],
                             include_stop_str_in_output=True)]
    before = spec_llm.stats()
    got = spec_llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    assert spec_delta(spec_llm, before)[1] > 50
    ref = llm.generate([prompt] * len(cases), cases, use_tqdm=False)
    for a, b, sp in zip(got, ref, cases):
        x, y = a.outputs[0], b.outputs[0]
        assert (x.text, x.token_ids, x.finish_reason, x.stop_reason) == (
            y.text, y.token_ids, y.finish_reason, y.stop_reason), sp
    idle(spec_llm)


def test_preemption_with_drafts_keeps_outputs(llm):
    small = LLM(speculative_config=SPEC, **dict(TEST_ENGINE, kv_cache_memory_bytes=None,
                                                   num_gpu_blocks_override=40))
    rng = np.random.default_rng(1)
    prompts, params = [], []
    for _ in range(12):  # a random 12-30 token phrase said three times: the model repeats it
        phrase = rng.integers(200, 20000, int(rng.integers(12, 30))).tolist()
        prompts.append({"prompt_token_ids": phrase * 3})
        params.append(SamplingParams(temperature=0, max_tokens=int(rng.integers(16, 48)),
                                     ignore_eos=True, logprobs=2))
    ref = llm.generate(prompts, params, use_tqdm=False)
    got = small.generate(prompts, params, use_tqdm=False)
    s = small.stats()
    assert s.num_preemptions > 0 and s.spec_decode_num_accepted_tokens > 50
    for a, b in zip(got, ref):
        assert_same_or_near_tie(a.outputs[0].token_ids, b.outputs[0].token_ids,
                                margins_from_logprobs(b.outputs[0].logprobs), what="preempted, drafts")
    idle(small)


def test_bad_words_and_logit_bias_with_drafts(llm, spec_llm):
    """Draft rows get their own bans: a bad word that the copy would produce mid-run is banned
    at the right row, exactly as without speculation."""
    prompt = chats(llm, COPY[1:])[0]
    params = [SamplingParams(temperature=0, max_tokens=40, bad_words=["budget"]),
              SamplingParams(temperature=0, max_tokens=40, bad_words=["library", "weekends"],
                             logit_bias={"13": 2.0}),
              SamplingParams(temperature=0.7, seed=5, max_tokens=40, bad_words=["members"])]
    ref = llm.generate([prompt] * 3, params, use_tqdm=False)
    before = spec_llm.stats()
    got = spec_llm.generate([prompt] * 3, params, use_tqdm=False)
    assert spec_delta(spec_llm, before)[1] > 20
    from jaxkv.engine.llm_engine import bad_words_token_ids
    for a, b, sp in zip(got, ref, params):
        ids = a.outputs[0].token_ids
        assert ids == b.outputs[0].token_ids, sp
        for s in bad_words_token_ids(llm.get_tokenizer(), sp.bad_words):  # vLLM's token rule
            assert not any(ids[i:i + len(s)] == s for i in range(len(ids)))
    unbanned = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    assert unbanned[0].outputs[0].token_ids != ref[0].outputs[0].token_ids  # "budget" was there
    idle(spec_llm)
