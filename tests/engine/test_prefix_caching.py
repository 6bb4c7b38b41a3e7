"""Prefix caching on vs off: identical greedy outputs, and shared prompt blocks computed once
even when the requests arrive together and are scheduled in the same step."""

from jaxkv import SamplingParams
from tests.helpers import assert_same_or_near_tie, margins_from_logprobs

SYSTEM = ("You are a meticulous assistant for a railway company. " * 4
          + "Rules: " + " ".join(f"Rule {i}: always check timetable section {i} before answering."
                                  for i in range(40)))
QUESTIONS = ["When does the first train leave?", "Can I bring a bicycle?", "Is there wifi?",
             "How do I get a refund?", "Are pets allowed?", "Where is platform 9?",
             "Do you sell day passes?", "What if my train is late?"]


def conversations():
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in QUESTIONS]


def test_shared_system_prompt_is_computed_once(llm, llm_no_prefix_cache):
    tok = llm.get_tokenizer()
    n_sys = len(tok.apply_chat_template(conversations()[0], tokenize=True, return_dict=False))
    assert n_sys > 600
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2)
    results = {}
    for name, engine in (("cached", llm), ("uncached", llm_no_prefix_cache)):
        engine.reset_prefix_cache()
        before = engine.stats()
        outs = engine.chat(conversations(), sp, use_tqdm=False)
        after = engine.stats()
        results[name] = (outs, after.num_computed_prompt_tokens - before.num_computed_prompt_tokens,
                         after.prefix_cache_hits - before.prefix_cache_hits)
        assert after.num_free_blocks == after.num_total_blocks  # every block released
    cached, uncached = results["cached"], results["uncached"]
    total_prompt = sum(len(o.prompt_token_ids) for o in uncached[0])
    assert uncached[1] == total_prompt and uncached[2] == 0
    assert cached[1] <= uncached[1] / 4, (cached[1], uncached[1])
    assert cached[2] > 0 and sum(o.num_cached_tokens for o in cached[0]) == cached[2]
    for a, b in zip(cached[0], uncached[0]):
        ref = b.outputs[0]
        assert_same_or_near_tie(a.outputs[0].token_ids, ref.token_ids,
                                margins_from_logprobs(ref.logprobs), what="prefix cache on vs off")


def test_multi_turn_chat_hits_previous_turns(llm):
    llm.reset_prefix_cache()
    sp = SamplingParams(temperature=0, max_tokens=12)
    conv = [{"role": "system", "content": SYSTEM}]
    hits = []
    for q in QUESTIONS[:3]:
        conv.append({"role": "user", "content": q})
        o = llm.chat(conv, sp, use_tqdm=False)[0]
        hits.append(o.num_cached_tokens)
        conv.append({"role": "assistant", "content": o.outputs[0].text})
    assert hits[0] == 0
    assert hits[1] >= 600 and hits[2] > hits[1]
