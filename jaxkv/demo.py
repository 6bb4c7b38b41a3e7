"""`make demo`: a batch of real prompts through the embedded SmolLM2, with outputs and tokens/s."""

from __future__ import annotations

import time

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a KV cache is.",
    "Give me three tips for writing clean Python code.",
    "What is 12 times 7?",
    "Name the planets of the solar system.",
    "Why is the sky blue? Answer briefly.",
    "Translate 'good morning' into Spanish, French and German.",
]


def main() -> None:
    from jaxkv import LLM, SamplingParams
    from jaxkv.engine_config import CPU_MAX_NUM_BATCHED_TOKENS, coarse_token_buckets

    # The coarse buckets only, all compiled before the first request: the demo's 8 requests
    # need no others, and a background compile would share the 2 cores with them.
    budget = CPU_MAX_NUM_BATCHED_TOKENS
    llm = LLM(max_num_batched_tokens=budget, token_buckets=coarse_token_buckets(budget))
    params = SamplingParams(temperature=0.0, max_tokens=96)
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    t0 = time.perf_counter()
    outs = llm.chat(convs, params)
    dt = time.perf_counter() - t0
    n = 0
    for p, o in zip(PROMPTS, outs):
        c = o.outputs[0]
        n += len(c.token_ids)
        print(f"\n### {p}\n{c.text.strip()}")
    s = llm.stats()
    print(f"\n{len(PROMPTS)} requests, {n} generated tokens in {dt:.1f} s: {n / dt:.1f} tokens/s "
          f"(continuous batching over a paged KV cache; {s.num_compilations} compiled programs, "
          f"{s.num_preemptions} preemptions)")


if __name__ == "__main__":
    main()
