"""A seeded request's tokens depend only on its own prompt, parameters and seed, never on the
sampling settings of the rows batched with it (handed case C1 of 2026-11-30)."""

from __future__ import annotations

import pytest

from jaxkv import SamplingParams
from tests.engine.conftest import _idle


def test_c1_case_as_written(llm):
    seeded = SamplingParams(temperature=0.8, seed=1, max_tokens=16)
    batch = llm.generate(["The river flows", "In the morning I", "Good soup needs"],
                         [SamplingParams(temperature=0, max_tokens=16), seeded,
                          SamplingParams(temperature=1.0, top_k=1, max_tokens=16)], use_tqdm=False)
    alone = llm.generate("In the morning I", seeded, use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone[0].outputs[0].token_ids


def test_c1_case_input_over_many_seeds_at_temperature_1(llm):
    # Alone the prompt runs in the 8-token bucket, in the batch in the 64-token one: the logits
    # differ in their last bits, and the exponential race must not let that flip a token.
    prompts = ["The river flows", "In the morning I", "Good soup needs"]
    for seed in range(3):
        seeded = SamplingParams(temperature=1.0, seed=seed, max_tokens=16)
        batch = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=16), seeded,
                                       SamplingParams(temperature=1.0, top_k=5, max_tokens=16)],
                             use_tqdm=False)
        alone = llm.generate(prompts[1], seeded, use_tqdm=False)
        assert batch[1].outputs[0].token_ids == alone[0].outputs[0].token_ids, seed


NEIGHBOURS = {
    "top_k": SamplingParams(temperature=1.0, top_k=5, max_tokens=12),
    "top_p": SamplingParams(temperature=0.9, top_p=0.5, max_tokens=12),
    "min_p": SamplingParams(temperature=1.0, min_p=0.2, max_tokens=12),
    "penalties": SamplingParams(temperature=1.0, repetition_penalty=1.4, frequency_penalty=0.5,
                                max_tokens=12),
    "logprobs": SamplingParams(temperature=1.0, logprobs=5, max_tokens=12),
    "min_tokens": SamplingParams(temperature=1.0, min_tokens=6, max_tokens=12),
}


@pytest.mark.parametrize("seeded", [
    SamplingParams(temperature=1.0, seed=7, max_tokens=12, ignore_eos=True),   # no filter at all
    SamplingParams(temperature=0.7, seed=123, n=2, max_tokens=12, ignore_eos=True),
])
def test_seeded_rows_ignore_neighbours_in_the_first_token_after_prefill(llm, seeded):
    prompt = "My favourite animal is"
    alone = [c.token_ids for c in llm.generate(prompt, seeded, use_tqdm=False)[0].outputs]
    for name, other in NEIGHBOURS.items():
        outs = llm.generate(["Write a poem about rain.", prompt, "1, 2, 3,"], [other, seeded, other],
                            use_tqdm=False)
        assert [c.token_ids for c in outs[1].outputs] == alone, name


def test_seeded_row_ignores_neighbours_that_join_while_it_decodes(llm):
    engine = llm.llm_engine
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    alone = llm.generate("The ocean is", seeded, use_tqdm=False)[0].outputs[0].token_ids
    for name in ("top_k", "penalties", "logprobs"):
        engine.add_request(f"s-{name}", "The ocean is", seeded)
        got = []
        for i in range(40):
            if i == 3:  # a neighbour arrives while the seeded request is decoding
                engine.add_request(f"n-{name}", "Tell me about trains.", NEIGHBOURS[name])
            for o in engine.step():
                if o.request_id == f"s-{name}" and o.finished:
                    got = o.outputs[0].token_ids
            if not engine.has_unfinished_requests():
                break
        assert got == alone, name
    assert _idle(llm)
