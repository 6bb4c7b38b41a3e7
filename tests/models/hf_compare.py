"""The two comparisons against transformers that the model-family tests share: a model's
logits through prefill, chunks and token-by-token decode on a paged runner, and one
LLM.generate with every engine feature at once against transformers' greedy tokens."""

from __future__ import annotations

import numpy as np
import torch

from jaxkv.engine_args import EngineArgs
from jaxkv.runner.model_runner import ModelRunner
from tests.models.test_architectures import BLOCK, run_paged


def assert_logits_match(hf, model, params, mc, vocab: int, tol: float, what: str,
                        quantization_config: dict | None = None) -> None:
    """jaxkv's logits of `model` (params, ModelConfig mc) equal transformers' `hf` within
    `tol` relative for 41 random ids fed at once, in chunks and one by one, through a
    non-contiguous block table."""
    config = EngineArgs(block_size=BLOCK, num_gpu_blocks_override=64, max_model_len=128,
                        max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 32, 64),
                        max_logprobs=0).create_engine_config(
                            platform="cpu", model_config=mc, quantization_config=quantization_config)
    runner = ModelRunner(model, params, config)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, vocab, 41).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    blocks = rng.permutation(np.arange(1, 64))[:11].tolist()
    for chunks in ([41], [16, 7, 18], [1] * 41):
        got = run_paged(runner, ids, chunks, blocks)
        err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
        assert err < tol, f"{what} chunks={chunks[:3]}: relative logit difference {err}"


def assert_generate_with_every_feature_matches(hf, path, vocab: int, what: str,
                                               num_blocks: int = 14) -> None:
    """Four prompts sharing a 24-token prefix (prefix caching), longer than the 16-token step
    budget (chunked prefill), in a pool of `num_blocks` blocks of 8 too small for all of them
    (preemption), one of them with n=2, under n-gram speculative decoding: greedy tokens equal
    transformers'."""
    from jaxkv import LLM, SamplingParams

    llm = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
              token_buckets=(8, 16), num_gpu_blocks_override=num_blocks, block_size=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                  "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    rng = np.random.default_rng(3)
    prefix = rng.integers(3, vocab, 24).tolist()
    prompts = [prefix + rng.integers(3, vocab, n).tolist() for n in (8, 12, 17, 20)]
    sps = [SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, n=2 if i == 1 else 1)
           for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)
    s = llm.stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0 and s.spec_decode_num_drafts > 0, s
    assert (s.num_window_freed_blocks > 0) == (s.kv_sliding_window is not None)  # every layer windowed
    for p, o in zip(prompts, outs):
        ref = greedy_reference(hf, p, 32)
        for c in o.outputs:
            assert list(c.token_ids) == ref, what


def greedy_reference(hf, prompt: list[int], n: int) -> list[int]:
    """transformers' n greedy tokens after `prompt` (no EOS stop)."""
    with torch.no_grad():
        return hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False,
                           eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()


def assert_gguf_gives_the_folders_tokens(folder, gguf_file, vocab: int, what: str) -> None:
    """A GGUF file written from the Hugging Face folder `folder` (whose tokenizer both use)
    gives the folder's 12 greedy tokens on 3 random prompts."""
    from jaxkv import LLM, SamplingParams

    kw = dict(tokenizer=str(folder), max_model_len=128, max_num_batched_tokens=64,
              token_buckets=(8, 64), kv_cache_memory_bytes=1 << 20, max_num_seqs=8)
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, vocab, n).tolist()} for n in (5, 17, 30)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    a = LLM(model=str(gguf_file), **kw).generate(prompts, sp, use_tqdm=False)
    b = LLM(model=str(folder), **kw).generate(prompts, sp, use_tqdm=False)
    for x, y in zip(a, b):
        assert len(x.outputs[0].token_ids) == 12 and x.outputs[0].token_ids == y.outputs[0].token_ids, what
