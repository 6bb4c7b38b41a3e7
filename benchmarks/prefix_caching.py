"""Prefix caching: 8 requests sharing a 1500-token system prompt cost about one prefill.

Workload (fixed by --seed): a system message of exactly 1500 tokens (sentences of common English
words drawn by the seed) and 8 different short user questions, rendered with the model's chat
template (ChatML). Measured with the embedded SmolLM2 (default engine arguments):

- prefill_s_cached / _uncached: the 8 conversations sent together in ONE `LLM.chat` call with
  max_tokens=1 (so the call is the prefill plus one sampled token), on a cold cache
  (`reset_prefix_cache()` before every timed call), with prefix caching on (median of
  --repeats calls, default 3), then off (a second engine, built after the first is freed; one
  call, the reference that costs 8 full prefills).
- prefill_s_single: one of those conversations alone, cold cache, same engine (caching on).
- computed_prompt_tokens_*: the rise of EngineStats.num_computed_prompt_tokens over one call,
  i.e. prompt tokens actually run through the model.
- chat_turn_computed_prompt_tokens: a 5-turn chat on the same system prompt (caching on, cold
  at turn 1) where each turn resends the whole history with the greedy assistant replies (up
  to 48 tokens) appended: computed prompt tokens per turn, beside each turn's prompt length.

Target (benchmarks issue): prefill_s_cached <= 1.3 x prefill_s_single. --quick: 4 requests
sharing a 1000-token system prompt, each figure timed once: about 2 minutes on 2 CPU cores (two
engine starts of ~25 s included); the full mode about 6 minutes.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import base_parser, print_table, save

_WORDS = ("the a of to and in for on with as by at from that this is are was be can will each "
         "system request model token cache memory block server user answer question data time "
         "value table index batch queue page layer vector query key attention engine output input "
         "rule policy service customer order account support product price report team project "
         "must should never always only first last next every other same new old small large "
         "fast slow clear short long simple careful polite helpful exact correct safe "
         "write read check keep send return explain describe list give use follow ask")
WORDS = _WORDS.split()
QUESTIONS = ["What is your main task?", "How should I format a reply?", "Summarize the rules in one line.",
             "Which rule matters most?", "Can you answer in French?", "What must you never do?",
             "How long may an answer be?", "Who is the customer here?"]


def system_prompt(tok, rng, num_tokens: int) -> str:
    """Seeded sentences of common words, cut to exactly num_tokens tokens."""
    sentences = []
    while len(sentences) < 400:
        words = list(rng.choice(WORDS, size=int(rng.integers(8, 17))))
        sentences.append(" ".join(words).capitalize() + ".")
    ids = tok.encode(" ".join(sentences), add_special_tokens=False)[:num_tokens]
    return tok.decode(ids)


def timed_chat(llm, convs, max_tokens=1, cold=True):
    """(seconds, computed prompt tokens, prompt tokens, outputs) of one LLM.chat call."""
    from jaxkv import SamplingParams

    if cold:
        llm.reset_prefix_cache()
    s0 = llm.stats()
    t0 = time.perf_counter()
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    dt = time.perf_counter() - t0
    s1 = llm.stats()
    return (dt, s1.num_computed_prompt_tokens - s0.num_computed_prompt_tokens,
            s1.num_prompt_tokens - s0.num_prompt_tokens, outs)


def main():
    ap = base_parser(__doc__, "4 requests sharing a 1000-token system prompt, each figure timed once")
    ap.add_argument("--repeats", type=int, default=None, help="timed calls, caching on (default 3, --quick 1)")
    ap.formatter_class = argparse.RawDescriptionHelpFormatter
    args = ap.parse_args()
    reps = args.repeats or (1 if args.quick else 3)
    num_requests, system_tokens = (4, 1000) if args.quick else (8, 1500)
    from jaxkv import LLM

    t_start = time.perf_counter()
    llm = LLM(enable_prefix_caching=True)
    llm.llm_engine.wait_for_background_compile()  # time the steady state
    tok = llm.get_tokenizer()
    system = system_prompt(tok, np.random.default_rng(args.seed), system_tokens)
    convs = [[{"role": "system", "content": system}, {"role": "user", "content": q}]
             for q in QUESTIONS[:num_requests]]
    timed_chat(llm, [[{"role": "user", "content": "Hello!"}]])  # warmup, untimed

    single = [timed_chat(llm, convs[:1]) for _ in range(reps)]
    cached = [timed_chat(llm, convs) for _ in range(reps)]
    prompt_lens = [len(o.prompt_token_ids) for o in cached[0][3]]

    history = [{"role": "system", "content": system}]
    turns = []
    for i in range(5):
        history.append({"role": "user", "content": QUESTIONS[i]})
        dt, computed, plen, outs = timed_chat(llm, [history], max_tokens=48, cold=(i == 0))
        turns.append({"turn": i + 1, "prompt_tokens": plen, "computed_prompt_tokens": computed,
                      "seconds": dt})
        history.append({"role": "assistant", "content": outs[0].outputs[0].text})
    del llm
    gc.collect()

    llm = LLM(enable_prefix_caching=False)

    llm.llm_engine.wait_for_background_compile()  # time the steady state
    timed_chat(llm, [[{"role": "user", "content": "Hello!"}]])  # warmup, untimed
    uncached = [timed_chat(llm, convs)]
    del llm
    gc.collect()

    def med(runs):
        return statistics.median(r[0] for r in runs)

    data = {"prefill_s_cached": med(cached), "prefill_s_uncached": med(uncached),
            "prefill_s_single": med(single),
            "computed_prompt_tokens_cached": cached[0][1], "computed_prompt_tokens_uncached": uncached[0][1],
            "computed_prompt_tokens_single": single[0][1],
            "prompt_tokens_total": cached[0][2], "prompt_tokens_per_request": prompt_lens,
            "chat_turn_computed_prompt_tokens": [t["computed_prompt_tokens"] for t in turns],
            "chat_turn_prompt_tokens": [t["prompt_tokens"] for t in turns],
            "num_requests": num_requests, "system_prompt_tokens": system_tokens, "repeats": reps}
    data["cached_over_single"] = data["prefill_s_cached"] / data["prefill_s_single"]
    data["uncached_over_cached"] = data["prefill_s_uncached"] / data["prefill_s_cached"]

    print(f"{num_requests} requests, system prompt {system_tokens} tokens; prompts of {min(prompt_lens)}-"
          f"{max(prompt_lens)} tokens with the chat template; cold cache, max_tokens=1, caching on: median "
          f"of {reps} call(s), off: one call\n")
    print_table([
        {"run": "1 request alone", "prefill s": data["prefill_s_single"],
         "prompt tokens": single[0][2], "computed": single[0][1]},
        {"run": f"{num_requests} together, caching on", "prefill s": data["prefill_s_cached"],
         "prompt tokens": cached[0][2], "computed": cached[0][1]},
        {"run": f"{num_requests} together, caching off", "prefill s": data["prefill_s_uncached"],
         "prompt tokens": uncached[0][2], "computed": uncached[0][1]}])
    print()
    print_table(turns)
    ratio = data["cached_over_single"]
    print(f"\ntarget: 8 shared-prefix requests <= 1.3 x one request: {num_requests} took {ratio:.2f}x "
          f"({'met' if ratio <= 1.3 else 'NOT met'}); caching off is {data['uncached_over_cached']:.1f}x "
          f"slower than on")
    print(f"total run time {time.perf_counter() - t_start:.0f} s")

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    names = ["1 request", f"{num_requests} shared-prefix\ncaching on", f"{num_requests} shared-prefix\ncaching off"]
    bars = a.bar(names, [data["prefill_s_single"], data["prefill_s_cached"], data["prefill_s_uncached"]],
                 color=["#888", "#3b75af", "#d0605e"])
    a.bar_label(bars, fmt="%.2f s")
    a.set_ylabel("prefill wall time (s)")
    a.set_title(f"{system_tokens}-token shared system prompt, cold cache")
    x = np.arange(1, 6)
    b.bar(x - 0.2, data["chat_turn_prompt_tokens"], 0.4, label="prompt tokens", color="#bbb")
    b.bar(x + 0.2, data["chat_turn_computed_prompt_tokens"], 0.4, label="computed (caching on)",
          color="#3b75af")
    b.set_xlabel("chat turn (whole history resent)")
    b.set_ylabel("tokens")
    b.legend()
    b.set_title("5-turn chat")
    save("prefix_caching", data, args, fig)


if __name__ == "__main__":
    main()
