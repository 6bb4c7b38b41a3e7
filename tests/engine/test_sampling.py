"""Sampling on device through the public API: seeds, top-k, stop strings, min_tokens,
ignore_eos, n > 1, logprobs, output kinds, and validation errors."""

import math

import pytest

from jaxkv import RequestOutputKind, SamplingParams

CHAT = [{"role": "user", "content": "Tell me a short story about a cat."}]


def texts(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_seeded_request_reproduces_alone_and_in_a_batch(llm):
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.chat(CHAT, sp, use_tqdm=False)[0].outputs[0].token_ids
    again = llm.chat(CHAT, sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [[{"role": "user", "content": f"Count to {i}."}] for i in range(5)]
    batch = llm.chat(others + [CHAT], [SamplingParams(temperature=0.7, max_tokens=30)] * 5 + [sp],
                     use_tqdm=False)
    assert alone == again == batch[-1].outputs[0].token_ids
    other_seed = llm.chat(CHAT, SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=24,
                                               ignore_eos=True), use_tqdm=False)[0]
    assert other_seed.outputs[0].token_ids != alone


def test_top_k_1_equals_greedy(llm):
    g = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)
    k1 = llm.chat(CHAT, SamplingParams(temperature=0.8, top_k=1, seed=7, max_tokens=20), use_tqdm=False)
    assert texts(g) == texts(k1)


def test_stop_string_across_tokens_is_cut(llm):
    tok = llm.get_tokenizer()
    base = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True), use_tqdm=False)[0]
    ids = base.outputs[0].token_ids
    # A stop string made of the end of token 5 and the start of token 6 spans a boundary.
    t5, t6 = tok.decode(ids[4:5]), tok.decode(ids[5:6])
    stop = t5[-2:] + t6[:2] if len(t5) >= 2 and len(t6) >= 2 else t5 + t6
    full = base.outputs[0].text
    idx = full.find(stop)
    assert idx >= 0
    for include in (False, True):
        o = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=40, stop=[stop],
                                          include_stop_str_in_output=include), use_tqdm=False)[0]
        c = o.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason == stop
        assert c.text == (full[:idx + len(stop)] if include else full[:idx])


def test_min_tokens_and_ignore_eos(llm):
    short = llm.chat([{"role": "user", "content": "Say just: yes"}],
                     SamplingParams(temperature=0, max_tokens=50), use_tqdm=False)[0].outputs[0]
    assert short.finish_reason == "stop" and short.token_ids[-1] == 2  # EOS kept in token_ids
    assert "<|im_end|>" not in short.text
    n = len(short.token_ids)
    forced = llm.chat([{"role": "user", "content": "Say just: yes"}],
                      SamplingParams(temperature=0, max_tokens=50, min_tokens=n + 5), use_tqdm=False)[0]
    assert len(forced.outputs[0].token_ids) >= n + 5
    assert 2 not in forced.outputs[0].token_ids[:n + 4]
    ign = llm.chat([{"role": "user", "content": "Say just: yes"}],
                   SamplingParams(temperature=0, max_tokens=n + 6, ignore_eos=True), use_tqdm=False)[0]
    assert len(ign.outputs[0].token_ids) == n + 6 and ign.outputs[0].finish_reason == "length"


def test_stop_token_ids(llm):
    base = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0].outputs[0]
    target = base.token_ids[3]
    o = llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[target]),
                 use_tqdm=False)[0].outputs[0]
    first = base.token_ids.index(target)
    assert o.token_ids == base.token_ids[:first + 1]
    assert o.finish_reason == "stop" and o.stop_reason == target


def test_n_samples_share_the_prompt_and_differ(llm):
    s0 = llm.stats()
    sp = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=16, ignore_eos=True)
    o = llm.chat(CHAT, sp, use_tqdm=False)[0]
    assert [c.index for c in o.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in o.outputs}) > 1
    s1 = llm.stats()
    # Children fork the parent's full prompt blocks: far fewer than 4 prompts are computed.
    assert s1.num_computed_prompt_tokens - s0.num_computed_prompt_tokens < 2 * len(o.prompt_token_ids)
    assert s1.num_free_blocks == s1.num_total_blocks
    # Sample j is reproducible: the same request again gives the same four samples.
    again = llm.chat(CHAT, sp, use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in o.outputs]


def test_n_samples_share_blocks_without_prefix_caching(llm_no_prefix_cache):
    eng = llm_no_prefix_cache
    s0 = eng.stats()
    o = eng.chat(CHAT, SamplingParams(n=3, temperature=0.8, seed=2, max_tokens=8, ignore_eos=True),
                 use_tqdm=False)[0]
    s1 = eng.stats()
    n_prompt = len(o.prompt_token_ids)
    computed = s1.num_computed_prompt_tokens - s0.num_computed_prompt_tokens
    assert computed < n_prompt + 2 * 16  # the children recompute at most their partial last block
    assert len(o.outputs) == 3 and all(len(c.token_ids) == 8 for c in o.outputs)
    assert s1.num_free_blocks == s1.num_total_blocks


def test_logprobs_and_prompt_logprobs_format(llm):
    o = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=3, logprobs=3,
                                                                 prompt_logprobs=2), use_tqdm=False)[0]
    c = o.outputs[0]
    assert len(c.logprobs) == 3
    for tid, d in zip(c.token_ids, c.logprobs):
        assert tid in d and d[tid].rank == 1 and 3 <= len(d) <= 4
        assert all(v.logprob <= 0 and isinstance(v.decoded_token, str) for v in d.values())
    assert math.isclose(c.cumulative_logprob, sum(d[t].logprob for t, d in zip(c.token_ids, c.logprobs)),
                        rel_tol=1e-5)
    pl = o.prompt_logprobs
    assert pl[0] is None and len(pl) == len(o.prompt_token_ids)
    for tid, d in zip(o.prompt_token_ids[1:], pl[1:]):
        assert tid in d and d[tid].rank >= 1


def test_output_kinds_through_the_engine(llm):
    eng = llm.llm_engine
    pieces, final = [], None
    eng.add_request("delta-1", "Count: one, two,", SamplingParams(temperature=0, max_tokens=12,
                                                                  output_kind=RequestOutputKind.DELTA))
    while eng.has_unfinished_requests():
        for out in eng.step():
            pieces.append(out.outputs[0].text)
            final = out
    full = llm.generate("Count: one, two,", SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    assert "".join(pieces) == full.outputs[0].text and final.finished
    assert len(pieces) > 1


def test_abort_frees_blocks(llm):
    eng = llm.llm_engine
    eng.add_request("abort-me", "Tell me everything about the sea.",
                    SamplingParams(max_tokens=200, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.stats().num_free_blocks < eng.stats().num_total_blocks
    outs = eng.abort_request("abort-me")
    assert outs and outs[0].outputs[0].finish_reason == "abort"
    s = eng.stats()
    assert s.num_free_blocks == s.num_total_blocks and not eng.has_unfinished_requests()


def test_invalid_prompts_lose_nothing(llm):
    before = llm.stats()
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}, {"prompt_token_ids": [1, 10**6]}], use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):  # max_tokens=None: whatever is left
        llm.generate({"prompt_token_ids": [5] * 1024}, SamplingParams(max_tokens=None), use_tqdm=False)
    with pytest.raises(ValueError, match="max_logprobs"):
        llm.generate("hi", SamplingParams(logprobs=21), use_tqdm=False)
    after = llm.stats()
    assert after.num_waiting == after.num_running == 0
    assert after.num_free_blocks == after.num_total_blocks
    assert after.num_prompt_tokens == before.num_prompt_tokens
