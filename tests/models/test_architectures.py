"""Each architecture of the Llama family against Hugging Face transformers (fp32 logits).

A tiny randomly initialised transformers model is saved with safetensors, loaded by jaxkv's
HF-folder loader, and run through the paged KV pool three ways: one-shot prefill, chunked
prefill, and token-by-token decode.
"""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

from jaxkv.engine_args import EngineArgs
from jaxkv.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxkv.loader.gguf import embedded_model_path
from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
from jaxkv.loader.hf import load_hf_dir
from jaxkv.models.llama import LlamaModel
from jaxkv.models.model_config import ModelConfig
from jaxkv.models.params import params_from_tensors
from jaxkv.runner.model_runner import ModelRunner
from jaxkv.sampling.params import SamplingParams

COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5)
ARCHS = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
              dict(rope_theta=10000.0, tie_word_embeddings=False)),
    "llama3_rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                    dict(rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                           high_freq_factor=4.0, original_max_position_embeddings=64),
                         rope_theta=500000.0, tie_word_embeddings=True)),
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=None, head_dim=16)),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True)),
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=32, tie_word_embeddings=False)),
}
BLOCK = 4


def run_paged(runner, ids, chunks, block_ids):
    """Feed `ids` in chunks of the given sizes; return logits [len(ids), vocab] from jaxkv."""
    rows, done = [], 0
    for n in chunks:
        s = ScheduledRequest("r", ids[done:done + n], done, block_ids, True, SamplingParams(), 0, 0, 0)
        out = SchedulerOutput([s])
        hidden = runner.forward(runner.build_inputs(out))
        rows.append(np.asarray(runner._logits(runner.params, hidden[:n])))
        done += n
    return np.concatenate(rows)


def make_hf(name, path):
    """A tiny random transformers model of architecture `name`, saved with safetensors to `path`."""
    cfg_cls, model_cls, extra = ARCHS[name]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**COMMON, **extra)).eval()
    with torch.no_grad():  # biases and norms start at 0 / 1: make them matter
        for n, p in hf.named_parameters():
            if "bias" in n or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer_from_gguf(embedded_model_path()).save_pretrained(path)  # any tokenizer will do
    return hf


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, make_hf(request.param, path), path


@pytest.mark.parametrize("cpu_matmul,fused,scan", [(False, False, False), (True, False, False),
                                                   (False, True, False), (True, True, False),
                                                   (False, True, True)],
                         ids=["xla", "cpu", "xla-fused", "cpu-fused", "xla-fused-scan"])
def test_logits_match_transformers(arch, cpu_matmul, fused, scan):
    """Prefill, chunks and token-by-token decode; with cpu_matmul the steps of bucket 8 run
    through the C++ few-row matmul, those of buckets 32 and 64 (the chunks, the 41-token
    prefill) through the C++ GEMM; without it every matmul is an XLA dot. `fused`: q/k/v and
    gate/up as one weight each (fused_projections, the GPU's layout), made from the same
    checkpoint. `scan`: the layers' weights stacked and run as one loop (scan_layers)."""
    name, hf, path = arch
    ckpt = load_hf_dir(str(path))
    mc = ModelConfig.from_hf_config(ckpt.config)
    model = LlamaModel(mc, cpu_matmul=cpu_matmul, fused_projections=fused, scan_layers=scan)
    params = params_from_tensors(model, ckpt.tensors)
    layer = params["layers"] if scan else params["layers_0"]
    assert ("qkv_proj" in layer and "gate_up_proj" in layer) == fused and ("q_proj" in layer) != fused
    assert ("layers_0" in params) != scan
    if scan:
        assert layer["o_proj"]["kernel"].shape[0] == COMMON["num_hidden_layers"]
    config = EngineArgs(block_size=BLOCK, num_gpu_blocks_override=64, max_model_len=128,
                        max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(8, 32, 64),
                        max_logprobs=0).create_engine_config(platform="cpu", model_config=mc)
    runner = ModelRunner(model, params, config)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, COMMON["vocab_size"], 41).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    perm = rng.permutation(np.arange(1, 64))[:11].tolist()  # non-contiguous block table
    for chunks, blocks in (([41], perm), ([16, 7, 18], perm[::-1]), ([1] * 41, sorted(perm))):
        got = run_paged(runner, ids, chunks, blocks)
        err = np.max(np.abs(got - ref))
        assert err < 1e-4, f"{name} chunks={chunks[:3]}...: max |logit diff| {err}"
    for n, target in ((1, "jaxkv_linear"), (41, "jaxkv_gemm")):  # buckets 8 and 64
        s = ScheduledRequest("r", ids[:n], 0, perm, True, SamplingParams(), 0, 0, 0)
        si = runner.build_inputs(SchedulerOutput([s]))
        hlo = runner.jitted_step.lower(runner.params, runner.kv_cache, si).as_text()
        assert (target in hlo) == cpu_matmul


@pytest.mark.parametrize("dtype,storage", [("bfloat16", "uint16"), ("float16", "float16")])
def test_half_precision_weights_track_float32(dtype, storage, tmp_path):
    """Weights (and so the KV pool) in bfloat16 / float16, the GPU's default: the engine
    builds (a bfloat16 pool is held as uint16 bits) and its logits stay within the dtype's
    rounding of transformers' float32 ones, through prefill and decode."""
    hf = make_hf("llama", tmp_path)
    ckpt = load_hf_dir(str(tmp_path))
    mc = ModelConfig.from_hf_config(ckpt.config)
    model = LlamaModel(mc, dtype=getattr(jnp, dtype))
    params = params_from_tensors(model, ckpt.tensors)
    config = EngineArgs(dtype=dtype, block_size=BLOCK, num_gpu_blocks_override=64,
                        max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64,
                        token_buckets=(8, 32, 64), max_logprobs=0).create_engine_config(
                            platform="cpu", model_config=mc)
    runner = ModelRunner(model, params, config)
    assert runner.kv_cache.dtype == dtype and runner.kv_cache.k.dtype == storage
    ids = np.random.default_rng(1).integers(0, COMMON["vocab_size"], 24).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].numpy()
    got = run_paged(runner, ids, [16] + [1] * 8, list(range(1, 8)))
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err < (0.05 if dtype == "bfloat16" else 0.01), err


@pytest.mark.parametrize("name", ["llama", "qwen3"])
def test_llm_on_hf_folder_generates_like_transformers(name, tmp_path):
    """End to end through LLM(model=folder): greedy tokens equal transformers' greedy tokens,
    and load_format="dummy" builds the same shapes with random weights."""
    from jaxkv import LLM

    hf, path = make_hf(name, tmp_path), tmp_path
    kw = dict(max_model_len=128, max_num_batched_tokens=64, token_buckets=(8, 64),
              kv_cache_memory_bytes=1 << 20, max_num_seqs=8)
    llm = LLM(model=str(path), **kw)
    prompts = [[5, 17, 42, 99, 3], list(range(20, 57))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                              min_new_tokens=12)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
    dummy = LLM(model=str(path), load_format="dummy", **kw)
    o = dummy.generate({"prompt_token_ids": prompts[0]}, SamplingParams(max_tokens=4, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(o.outputs[0].token_ids) == 4
    assert all(0 <= t < COMMON["vocab_size"] for t in o.outputs[0].token_ids)
