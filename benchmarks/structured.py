"""Structured outputs: what a JSON-schema constraint costs the requests around it.

The embedded SmolLM2-135M-Instruct (float32, default engine) runs two batches of 32 chat
requests submitted at once (all run concurrently), after the background compile and an untimed
warmup of both kinds:
- free: the 32 prompts of tests/data/json_schemas.json (the first 32), unconstrained,
  greedy, ignore_eos, 64 tokens each;
- mixed: the same 32 prompts, the even ones constrained by their schema (greedy, strict as
  OpenAI's strict mode: additionalProperties false, up to 96 tokens, ending where the grammar
  may end), the odd ones free as above.
TPOT per request = (last token time - first token time) / (tokens - 1). tpot_ratio = the mean
TPOT of the mixed batch over that of the free batch (target <= 1.15); the constrained and the
free halves of the mixed batch are reported apart. valid_fraction: constrained outputs that
parse and validate with jsonschema. The constrained requests end early (their JSON is done), so
the mixed batch thins out; the host time of the masks per step is reported too. Schema
compile time: for each of the 40 schemas, checking
it and building its matcher up to the first mask (what runs on the grammar pool), p50 / p99.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
from common import base_parser, print_table, save

SCHEMAS = os.path.join(os.path.dirname(__file__), "..", "tests", "data", "json_schemas.json")


def tpots(outs) -> list[float]:
    out = []
    for o in outs:
        m, n = o.metrics, len(o.outputs[0].token_ids)
        if n > 1:
            out.append((m.last_token_time - m.first_token_time) / (n - 1))
    return out


def compile_times(llm, schemas) -> list[float]:
    """Seconds per schema: validate against the tokenizer, build the matcher, first mask."""
    import llguidance
    import llguidance.numpy

    from jaxkv import StructuredOutputsParams
    llt = llm.llm_engine.structured_output_manager.ll_tokenizer
    mask = llguidance.numpy.allocate_token_bitmask(1, llt.vocab_size)
    ts = []
    for s in schemas:
        t0 = time.perf_counter()
        g = StructuredOutputsParams(json=s["schema"]).validate(llt)
        m = llguidance.LLMatcher(llt, g)
        llguidance.numpy.fill_next_token_bitmask(m, mask, 0)
        ts.append(time.perf_counter() - t0)
    return ts


def main():
    p = base_parser("TPOT of JSON-constrained and free requests against free ones",
                    "16 requests instead of 32 (8 constrained), 32 free tokens")
    args = p.parse_args()
    t_start = time.perf_counter()
    import jsonschema

    from jaxkv import LLM, SamplingParams, StructuredOutputsParams
    schemas = json.load(open(SCHEMAS))
    num, free_tokens = (16, 32) if args.quick else (32, 64)
    work = schemas[:num]
    llm = LLM(seed=args.seed)
    llm.llm_engine.wait_for_background_compile()
    chats = [[{"role": "user", "content": s["prompt"]}] for s in work]
    free = SamplingParams(temperature=0, max_tokens=free_tokens, ignore_eos=True)

    def constrained(s):
        return SamplingParams(temperature=0, max_tokens=96, structured_outputs=StructuredOutputsParams(
            json=s["schema"], disable_additional_properties=True))

    mixed = [constrained(s) if i % 2 == 0 else free for i, s in enumerate(work)]
    mgr, fill_s = llm.llm_engine.structured_output_manager, []
    fill = mgr.fill_bitmasks

    def timed_fill(states):  # the host cost of the masks, per step
        t0 = time.perf_counter()
        out = fill(states)
        fill_s.append(time.perf_counter() - t0)
        return out
    mgr.fill_bitmasks = timed_fill
    llm.chat(chats[:2], [mixed[0], free], use_tqdm=False)  # untimed warmup of both kinds
    runs = {}
    for name, params in (("free", [free] * num), ("mixed", mixed), ("free_again", [free] * num)):
        fill_s.clear()
        t0 = time.perf_counter()
        outs = llm.chat(chats, params, use_tqdm=False)
        runs[name] = (outs, time.perf_counter() - t0)
        if name == "mixed":
            mask_steps, mask_ms = len(fill_s), 1e3 * float(np.mean(fill_s))
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
    free_tpot = float(np.mean(tpots(runs["free"][0] + runs["free_again"][0])))
    outs = runs["mixed"][0]
    con, fre = outs[0::2], outs[1::2]
    valid = 0
    for o, s in zip(con, work[0::2]):
        try:
            jsonschema.validate(json.loads(o.outputs[0].text), s["schema"])
            valid += o.outputs[0].finish_reason == "stop"
        except ValueError:
            pass
        except jsonschema.ValidationError:
            pass
    ct = np.array(compile_times(llm, schemas)) * 1e3
    rows = [
        {"batch": "32 free" if num == 32 else f"{num} free", "requests": "free",
         "mean_tpot_ms": free_tpot * 1e3, "vs_free": 1.0,
         "output_tokens": sum(len(o.outputs[0].token_ids) for o in runs["free"][0])},
        {"batch": "mixed", "requests": "constrained", "mean_tpot_ms": np.mean(tpots(con)) * 1e3,
         "vs_free": np.mean(tpots(con)) / free_tpot,
         "output_tokens": sum(len(o.outputs[0].token_ids) for o in con)},
        {"batch": "mixed", "requests": "free", "mean_tpot_ms": np.mean(tpots(fre)) * 1e3,
         "vs_free": np.mean(tpots(fre)) / free_tpot,
         "output_tokens": sum(len(o.outputs[0].token_ids) for o in fre)},
        {"batch": "mixed", "requests": "all", "mean_tpot_ms": np.mean(tpots(outs)) * 1e3,
         "vs_free": np.mean(tpots(outs)) / free_tpot,
         "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)},
    ]
    for r in rows:
        r["mean_tpot_ms"], r["vs_free"] = float(r["mean_tpot_ms"]), float(r["vs_free"])
    print_table(rows, ["batch", "requests", "output_tokens", "mean_tpot_ms", "vs_free"], floatfmt="{:.3f}")
    print(f"bitmask fill on the host: {mask_ms:.2f} ms per step over {mask_steps} steps")
    print(f"valid constrained outputs: {valid}/{len(con)}; schema compile p50 "
          f"{np.percentile(ct, 50):.1f} ms, p99 {np.percentile(ct, 99):.1f} ms (40 schemas)")
    data = {"tpot_ratio": rows[3]["vs_free"], "tpot_ratio_constrained": rows[1]["vs_free"],
            "tpot_ratio_free_neighbours": rows[2]["vs_free"], "valid_fraction": valid / len(con),
            "schema_compile_ms_p50": float(np.percentile(ct, 50)),
            "schema_compile_ms_p99": float(np.percentile(ct, 99)),
            "bitmask_fill_ms_per_step": mask_ms, "bitmask_steps": mask_steps,
            "free_tpot_ms": free_tpot * 1e3, "rows": rows, "requests": num,
            "seconds": time.perf_counter() - t_start}
    save("structured", data, args)


if __name__ == "__main__":
    main()
