"""HF parity on the real model: jaxkv's greedy tokens equal transformers' (PyTorch, fp32, same
GGUF) for 32 new tokens on six chat prompts, and first-step log-probabilities agree."""

import numpy as np
import torch

from jaxkv import SamplingParams
from tests.helpers import assert_same_or_near_tie

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a five-year-old.",
    "List three prime numbers greater than 100.",
    "Translate 'thank you very much' into German.",
    "What does a KV cache store in a transformer? Answer in one sentence.",
]
NEW = 32


def hf_greedy(model, ids, n):
    """Greedy ids, per-step top-2 margins and first-step log-probabilities from transformers."""
    out, margins, first = [], [], None
    x = torch.tensor([ids])
    past = None
    with torch.no_grad():
        for step in range(n):
            o = model(x, past_key_values=past, use_cache=True)
            past = o.past_key_values
            lp = torch.log_softmax(o.logits[0, -1].double(), -1)
            if first is None:
                first = lp.numpy()
            top = torch.topk(lp, 2).values
            margins.append(float(top[0] - top[1]))
            t = int(torch.argmax(lp))
            out.append(t)
            x = torch.tensor([[t]])
    return out, margins, first


def test_greedy_tokens_and_first_logprobs_match_transformers(llm, hf_smollm2):
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": p}] for p in PROMPTS]
    sp = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True, logprobs=20)
    outs = llm.chat(convs, sp, use_tqdm=False)
    for conv, prompt, o in zip(convs, PROMPTS, outs):
        ids = o.prompt_token_ids
        assert ids == tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        ref, margins, first = hf_greedy(hf_smollm2, ids, NEW)
        got = o.outputs[0].token_ids
        assert len(got) == NEW
        assert_same_or_near_tie(got, ref, margins, what=prompt)
        lp0 = o.outputs[0].logprobs[0]
        assert len(lp0) >= 20
        err = max(abs(v.logprob - first[k]) for k, v in lp0.items())
        assert err < 1e-3, f"first-step logprobs differ by {err}"
        assert lp0[got[0]].rank == 1


def test_penalized_greedy_matches_transformers_logits_with_vllm_penalties(llm, hf_smollm2):
    # A 100-token prompt (the penalty arrays are padded to a width holding the step's longest
    # prompt or output, here 512) and vLLM's three penalties applied to transformers' logits.
    rep, freq, pres = 1.3, 0.4, 0.3
    ids = [int(t) for t in np.random.default_rng(3).integers(100, 20000, 100)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=rep,
                        frequency_penalty=freq, presence_penalty=pres)
    got = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0].outputs[0].token_ids
    ref, margins, seq = [], [], list(ids)
    with torch.no_grad():
        for _ in range(12):
            z = hf_smollm2(torch.tensor([seq])).logits[0, -1].double().numpy()
            seen = np.zeros(z.shape, bool)
            seen[seq] = True
            z = np.where(seen, np.where(z > 0, z / rep, z * rep), z)
            counts = np.bincount(ref, minlength=z.shape[0])
            z = z - freq * counts - pres * (counts > 0)
            top = np.sort(z)[-2:]
            margins.append(float(top[1] - top[0]))
            ref.append(int(np.argmax(z)))
            seq.append(ref[-1])
    assert_same_or_near_tie(got, ref, margins, what="penalized greedy")
