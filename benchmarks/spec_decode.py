"""Speculative decoding (n-gram prompt lookup): output tok/s with and without it.

Two engines with the default CPU arguments (the embedded SmolLM2, float32), one plain and one
with --speculative-config '{"method": "ngram", "num_speculative_tokens": 7,
"prompt_lookup_max": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 4}', both after their
background compile and one untimed request, run the same greedy requests side by side (plain
first, then speculative, per workload). 7 drafts make a drafted single-sequence step 8 tokens,
exactly the token bucket it pads to anyway. disable_by_batch_size (vLLM's name): no drafts
while 4 or more requests run; on 2 CPU cores a drafted step of 16 sequences costs about 3.5x a
plain one (its attention runs the ragged path over every query row), more than it yields.

- grounded: chat requests whose answer copies its input: "copy this paragraph, replacing one
  word" and "repeat this text word for word" over 8 fixed paragraphs (16 prompts);
- code: "rename this function and show the full code" over 8 snippets (the 135M model often
  explains the code instead of rewriting it: shown for what it is);
- free: 16 open-ended chat questions (stories, explanations), whose answers repeat little.

single: the first --single prompts of a workload, one request at a time (one LLM.chat call
each; output tokens / summed wall time). batchN: the workload's N prompts in one call.
max_tokens 128. Per run: tok/s, speedup (speculative / plain), the draft acceptance rate and
acceptance per draft position (from LLM.stats()), and whether every greedy output matched.

Targets (speculative-decoding issue): >= 1.8x single stream on grounded, >= 0.95x on free,
batch16 >= 1.0x on grounded. The last line is JSON with single_grounded_speedup,
single_free_speedup, batch16_grounded_speedup, batch16_free_speedup, single_code_speedup,
batch8_code_speedup and greedy_identical. --quick: 4 single-stream prompts and 64 new tokens,
3-4 minutes on 2 cores (engine starts included); the full run (8 prompts, 128 tokens) 4-6
minutes.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import base_parser, print_table, save

SPEC = {"method": "ngram", "num_speculative_tokens": 7, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
        "disable_by_batch_size": 4}

PARAGRAPHS = [
    ("The committee met on Tuesday to review the budget for the new library. After a long discussion, "
     "the members agreed to increase funding for children's books and to extend opening hours on "
     "weekends. The final report will be published next month on the city website.", "Tuesday", "Friday"),
    ("Our team moved the database to a new server last night. The migration took four hours and no "
     "data was lost. Users may notice slower searches for a day while the indexes are rebuilt.",
     "four", "six"),
    ("The museum will open a new exhibition about ancient Egypt in March. Visitors can see jewelry, "
     "tools and a painted coffin that has never been shown outside Cairo. Tickets go on sale next week.",
     "March", "April"),
    ("Please remember that the office will be closed on Monday for the holiday. Any urgent requests "
     "should be sent to the support address, which is checked twice a day by the team on call.",
     "Monday", "Thursday"),
    ("The river flooded the lower part of the village after three days of heavy rain. Volunteers "
     "filled sandbags through the night, and the school gym was opened as a shelter for families.",
     "three", "five"),
    ("Green tea contains less caffeine than coffee, but it still helps many people stay alert. It is "
     "best brewed with water that is hot but not boiling, for about two minutes.", "two", "three"),
    ("The new train line connects the airport with the city center in twenty minutes. Trains run "
     "every ten minutes during the day and every half hour at night, seven days a week.",
     "twenty", "fifteen"),
    ("Our bakery now offers a gluten free bread made with rice flour and seeds. It is baked every "
     "morning at six and usually sells out before noon, so we suggest ordering it in advance.",
     "six", "five"),
]
CODE = [
    ("def moving_average(values, window):\n    result = []\n    total = 0.0\n    for i, v in "
     "enumerate(values):\n        total += v\n        if i >= window:\n            total -= "
     "values[i - window]\n        if i >= window - 1:\n            result.append(total / window)\n"
     "    return result\n", "moving_average", "rolling_mean"),
    ("def count_words(text):\n    counts = {}\n    for word in text.lower().split():\n        "
     "word = word.strip('.,!?')\n        counts[word] = counts.get(word, 0) + 1\n    return counts\n",
     "count_words", "word_histogram"),
    ("def is_prime(n):\n    if n < 2:\n        return False\n    i = 2\n    while i * i <= n:\n"
     "        if n % i == 0:\n            return False\n        i += 1\n    return True\n",
     "is_prime", "check_prime"),
    ("def flatten(items):\n    out = []\n    for item in items:\n        if isinstance(item, list):\n"
     "            out.extend(flatten(item))\n        else:\n            out.append(item)\n    return out\n",
     "flatten", "flatten_list"),
    ("def read_config(path):\n    config = {}\n    with open(path) as f:\n        for line in f:\n"
     "            line = line.strip()\n            if not line or line.startswith('#'):\n"
     "                continue\n            key, value = line.split('=', 1)\n"
     "            config[key.strip()] = value.strip()\n    return config\n", "read_config", "load_settings"),
    ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
     "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
     "        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
     "    return -1\n", "binary_search", "find_index"),
    ("def celsius_to_fahrenheit(c):\n    return c * 9 / 5 + 32\n\n\ndef fahrenheit_to_celsius(f):\n"
     "    return (f - 32) * 5 / 9\n", "celsius_to_fahrenheit", "c_to_f"),
    ("class Counter:\n    def __init__(self):\n        self.value = 0\n\n    def increment(self):\n"
     "        self.value += 1\n        return self.value\n\n    def reset(self):\n        self.value = 0\n",
     "Counter", "Tally"),
]
FREE = ["Write a short story about a robot who learns to paint.",
        "Explain why the sky is blue to a ten-year-old.",
        "What are three good habits for staying healthy? Explain each.",
        "Describe a perfect weekend in the mountains.",
        "Give me some advice for my first job interview.",
        "Write a poem about the ocean at night.",
        "Why do people enjoy music? Give a few reasons.",
        "Tell me about the history of bicycles in a few paragraphs.",
        "How do plants make food from sunlight?",
        "Invent a new board game and describe its rules.",
        "What would you pack for a week-long camping trip, and why?",
        "Write a letter to a friend who moved to another country.",
        "Explain how a refrigerator keeps food cold.",
        "Describe your ideal city of the future.",
        "What makes a good teacher? Give examples.",
        "Write a short dialogue between a cat and a dog."]


def grounded_prompts() -> list[str]:
    out = []
    for text, a, b in PARAGRAPHS:
        out.append(f"Copy the following paragraph, replacing '{a}' with '{b}'. Output only the "
                   f"paragraph.\n\n{text}")
        out.append(f"Repeat this text word for word:\n\n{text}")
    return out


def code_prompts() -> list[str]:
    return [f"Rename {f} to {g} in this code and show the full code.\n\n```python\n{code}```"
            for code, f, g in CODE]


def run(llm, prompts, max_tokens: int, one_at_a_time: bool) -> dict:
    from jaxkv import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    convs = [[{"role": "user", "content": p}] for p in prompts]
    s0 = llm.stats()
    t0 = time.perf_counter()
    if one_at_a_time:
        outs = [o for c in convs for o in llm.chat([c], sp, use_tqdm=False)]
    else:
        outs = llm.chat(convs, sp, use_tqdm=False)
    secs = time.perf_counter() - t0
    s1 = llm.stats()
    ids = [o.outputs[0].token_ids for o in outs]
    n = sum(map(len, ids))
    drafts = s1.spec_decode_num_drafts - s0.spec_decode_num_drafts
    drafted = s1.spec_decode_num_draft_tokens - s0.spec_decode_num_draft_tokens
    accepted = s1.spec_decode_num_accepted_tokens - s0.spec_decode_num_accepted_tokens
    per_pos = [round((a - b) / drafts, 3) if drafts else None for a, b in zip(
        s1.spec_decode_num_accepted_tokens_per_pos, s0.spec_decode_num_accepted_tokens_per_pos)]
    return {"ids": ids, "tokens": n, "seconds": round(secs, 2), "tok_s": round(n / secs, 1),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else None,
            "acceptance_per_pos": per_pos,
            "mean_acceptance_length": round(1 + accepted / drafts, 2) if drafts else None}


def main(argv=None) -> int:
    p = base_parser(__doc__.splitlines()[0], "4 single-stream prompts, 64 new tokens (~3-4 min)")
    p.add_argument("--single", type=int, default=None, help="single-stream prompts per workload "
                   "(default 8; 4 with --quick)")
    args = p.parse_args(argv)
    single = args.single or (4 if args.quick else 8)
    max_tokens = 64 if args.quick else 128
    from jaxkv import LLM
    plain, spec = LLM(), LLM(speculative_config=SPEC)
    for llm in (plain, spec):
        llm.llm_engine.wait_for_background_compile()
        run(llm, FREE[:1], 16, True)  # first use: weights paged in, caches filled
    workloads = {"grounded": grounded_prompts(), "code": code_prompts(), "free": FREE}
    rows, identical, mismatches = [], True, 0
    for name, prompts in workloads.items():
        for mode, chosen, alone in (("single", prompts[:single], True),
                                    (f"batch{len(prompts)}", prompts, False)):
            a = run(plain, chosen, max_tokens, alone)
            b = run(spec, chosen, max_tokens, alone)
            same = sum(x == y for x, y in zip(a["ids"], b["ids"]))
            identical &= same == len(chosen)
            mismatches += len(chosen) - same
            rows.append({"workload": name, "mode": mode, "requests": len(chosen),
                         "plain_tok_s": a["tok_s"], "spec_tok_s": b["tok_s"],
                         "speedup": round(b["tok_s"] / a["tok_s"], 2),
                         "acceptance_rate": b["acceptance_rate"],
                         "mean_acceptance_length": b["mean_acceptance_length"],
                         "acceptance_per_pos": b["acceptance_per_pos"],
                         "outputs_identical": f"{same}/{len(chosen)}"})
    print_table(rows)
    data = {"rows": rows, "speculative_config": SPEC, "max_tokens": max_tokens,
            "greedy_identical": identical, "greedy_mismatches": mismatches}
    for r in rows:
        data[f"{r['mode']}_{r['workload']}_speedup"] = r["speedup"]
    save("spec_decode", data, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
