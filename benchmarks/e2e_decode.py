"""End-to-end decode throughput of the engine on a model config with random weights.

  python -m benchmarks.e2e_decode --config benchmarks/configs/llama3-8b --batches 1 32 128
  python -m benchmarks.e2e_decode --cpu-dry-run     # a tiny config on a CPU, interpret mode

The weights are generated on the device (load_format="dummy"); the folder gets a word-level
tokenizer made here with `tokenizers` (one token per id), since a config folder ships none and
nothing can be downloaded on the device. Prompts are random token ids, generation ignores EOS,
prefix caching is off. Decode throughput at batch B = B * N / (t(1 + N tokens) - t(1 token)),
so the prefill and the first token cancel out. Each batch size gets its own engine whose only
token bucket is that size (one compiled step program); its row is written once measured.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time

import numpy as np

from benchmarks.result_rows import Rows

TINY_CONFIG = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128,
                   intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                   num_hidden_layers=2, vocab_size=512, max_position_embeddings=512,
                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
                   bos_token_id=1, eos_token_id=2)


def model_folder(config: dict, where: str) -> str:
    """config.json plus a word-level tokenizer with one token per id, in a new folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "config.json"), "w") as f:
        json.dump(config, f)
    vocab = {f"<t{i}>": i for i in range(config["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<t0>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(where, "tokenizer.json"))
    with open(os.path.join(where, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<t0>",
                   "bos_token": f"<t{config.get('bos_token_id') or 0}>",
                   "eos_token": f"<t{config.get('eos_token_id') or 0}>"}, f)
    return where


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=os.path.join(os.path.dirname(__file__), "configs", "llama3-8b"))
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "pallas", "xla"])
    ap.add_argument("--kv-cache-memory-bytes", default="8GiB")
    ap.add_argument("--cpu-dry-run", action="store_true",
                    help="tiny config, few tokens, pallas in interpret mode on a CPU")
    a = ap.parse_args(argv)
    if a.cpu_dry_run:
        config = TINY_CONFIG
        a.batches, a.prompt_len, a.decode_tokens = [1, 3], 8, 3
        a.attention_backend, a.kv_cache_memory_bytes = "pallas", "4MiB"
    else:
        with open(os.path.join(a.config, "config.json")) as f:
            config = json.load(f)

    import jax
    import jax.numpy as jnp

    from jaxkv import LLM, SamplingParams

    rows = Rows("4_e2e_decode")
    tmp = tempfile.mkdtemp(prefix="jaxkv-e2e-")
    try:
        folder = model_folder(config, tmp)
        max_len = a.prompt_len + a.decode_tokens + 16
        rng = np.random.default_rng(0)
        for b in a.batches:
            # One engine per batch size, compiling just that bucket, so each row lands as soon
            # as its own program is compiled and timed.
            gc.collect()
            t0 = time.perf_counter()
            llm = LLM(model=folder, load_format="dummy", attention_backend=a.attention_backend,
                      max_model_len=max_len, max_num_seqs=b, max_num_batched_tokens=b,
                      token_buckets=(b,), enable_prefix_caching=False,
                      kv_cache_memory_bytes=a.kv_cache_memory_bytes)
            build_s = time.perf_counter() - t0
            prompts = [{"prompt_token_ids": rng.integers(3, config["vocab_size"], a.prompt_len).tolist()}
                       for _ in range(b)]
            one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
            many = SamplingParams(temperature=0, max_tokens=1 + a.decode_tokens, ignore_eos=True)
            llm.generate(prompts, one, use_tqdm=False)  # first use: sampler compiles, caches warm
            t0 = time.perf_counter()
            llm.generate(prompts, one, use_tqdm=False)
            t_one = time.perf_counter() - t0
            t0 = time.perf_counter()
            outs = llm.generate(prompts, many, use_tqdm=False)
            t_many = time.perf_counter() - t0
            assert all(len(o.outputs[0].token_ids) == 1 + a.decode_tokens for o in outs)
            dt = max(t_many - t_one, 1e-9)
            model = llm.llm_engine.runner.model
            rows.add(model="tiny" if a.cpu_dry_run else os.path.basename(os.path.normpath(a.config)),
                     backend=model.attention.name, dtype=jnp.dtype(model.dtype).name, batch=b,
                     prompt_len=a.prompt_len, decode_tokens=a.decode_tokens,
                     decode_tokens_per_s=round(b * a.decode_tokens / dt, 1),
                     ms_per_decode_step=round(1e3 * dt / a.decode_tokens, 2),
                     engine_build_s=round(build_s, 1), device=str(jax.devices()[0]))
            del llm, outs, model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
