"""`jaxkv convert` checks in a process of their own (orbax's worker threads must never run
beside pytest's assertion rewriting: CPython 3.11's ast module keeps one recursion counter
per interpreter, and two threads parsing at once raise "AST constructor recursion depth
mismatch"). `python -m tests.loader.converted_check OUT_DIR` prints one JSON line for
tests/loader/test_converted.py; `... --families OUT_DIR` converts a tiny Mixtral, Qwen2-MoE,
Gemma 2 and Gemma 3 and prints whether each converted folder gives its folder's tokens."""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading


def main(out: str) -> dict:
    import jax
    import numpy as np

    from jaxkv import LLM, SamplingParams
    from jaxkv.loader.converted import PARAMS, convert, restore_params
    from jaxkv.loader.source import is_converted
    from jaxkv.loader.source import read_config
    from jaxkv.models.llama import LlamaModel
    from jaxkv.models.model_config import ModelConfig
    from tests.conftest import TEST_ENGINE

    r = {}
    before = set(threading.enumerate())
    r["seconds"] = convert(None, out)
    r["threads_left"] = [t.name for t in set(threading.enumerate()) - before if t.is_alive()]
    r["is_converted"] = [is_converted(out), is_converted(None)]
    llm, conv = LLM(**TEST_ENGINE), LLM(model=out, **TEST_ENGINE)
    a, b = llm.llm_engine.runner.params, conv.llm_engine.runner.params
    r["same_tree"] = jax.tree.structure(a) == jax.tree.structure(b)
    r["same_params"] = all(x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
                           for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    chat = [{"role": "user", "content": "Name a planet."}]
    r["same_template"] = all(t.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
                             == llm.get_tokenizer().apply_chat_template(chat, tokenize=False,
                                                                        add_generation_prompt=True)
                             for t in (conv.get_tokenizer(),))
    sp = SamplingParams(temperature=0, max_tokens=12)
    want, got = (x.chat(chat, sp, use_tqdm=False)[0].outputs[0] for x in (llm, conv))
    r["same_output"] = got.token_ids == want.token_ids and got.text == want.text
    errors = {}
    try:
        convert(None, out)
    except ValueError as e:
        errors["not_empty"] = str(e)
    cfg = dict(read_config(out), num_hidden_layers=2)
    try:
        restore_params(out, LlamaModel(ModelConfig.from_hf_config(cfg)))
    except ValueError as e:
        errors["other_model"] = str(e)
    broken = out + "_broken"
    shutil.copytree(out, broken)
    shutil.rmtree(os.path.join(broken, PARAMS, "d"))  # the array data gone
    try:
        restore_params(broken, LlamaModel(ModelConfig.from_hf_config(read_config(out))))
    except ValueError as e:
        errors["broken"] = str(e)
    r["errors"] = errors
    return r


def families(out: str) -> dict:
    """{family: converted folder's greedy tokens == the Hugging Face folder's} for two
    mixtures of experts and two sliding-window families, random tiny models."""
    import numpy as np

    from jaxkv import LLM, SamplingParams
    from jaxkv.loader.converted import convert
    from tests.models.test_moe import make_moe
    from tests.models.test_sliding_window_models import make_windowed

    kw = dict(max_model_len=128, max_num_batched_tokens=64, token_buckets=(8, 64),
              kv_cache_memory_bytes=1 << 20, max_num_seqs=8)
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, 200, n).tolist()} for n in (5, 17, 30)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    same = {}
    for name, make in (("mixtral", make_moe), ("qwen2_moe", make_moe),
                       ("gemma2", make_windowed), ("gemma3", make_windowed)):
        folder, converted = os.path.join(out, name), os.path.join(out, name + "_converted")
        make(name, folder)
        convert(folder, converted)
        a, b = (LLM(model=m, **kw).generate(prompts, sp, use_tqdm=False) for m in (folder, converted))
        same[name] = all(x.outputs[0].token_ids == y.outputs[0].token_ids for x, y in zip(a, b))
    return same


if __name__ == "__main__":
    if sys.argv[1] == "--families":
        print("CONVERTED " + json.dumps(families(sys.argv[2])), flush=True)
    else:
        print("CONVERTED " + json.dumps(main(sys.argv[1])), flush=True)
