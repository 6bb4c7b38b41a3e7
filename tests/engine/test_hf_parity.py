"""HF parity on the real model: jaxkv's greedy tokens equal transformers' (PyTorch, fp32, same
GGUF) for 32 new tokens on six chat prompts, and first-step log-probabilities agree."""

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
