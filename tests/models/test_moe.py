"""Mixtures of experts (jaxkv/models/moe.py) against transformers, float32: tiny random
Mixtral, Qwen3-MoE (a dense layer among the MoE ones, renormalized top-k) and Qwen2-MoE (a
shared expert and its gate, q/k/v biases) saved as Hugging Face folders. Logits within 1e-4
relative through prefill, chunks and decode; greedy tokens equal transformers' through one
LLM.generate that exercises prefix caching, chunked prefill, preemption, n=2 and speculative
decoding at once; parameters counted as transformers counts them (total and active)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers

from jaxkv.engine_args import EngineArgs
from jaxkv.loader.gguf import embedded_model_path
from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
from jaxkv.loader.hf import load_hf_dir
from jaxkv.models.llama import LlamaModel
from jaxkv.models.model_config import ModelConfig
from jaxkv.models.params import params_from_tensors
from tests.models.hf_compare import (assert_generate_with_every_feature_matches,
                                      assert_gguf_gives_the_folders_tokens, assert_logits_match)

COMMON = dict(vocab_size=211, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
MOE = {
    "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                dict(intermediate_size=48, num_local_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                  dict(intermediate_size=96, moe_intermediate_size=32, num_experts=8,
                       num_experts_per_tok=2, norm_topk_prob=True, head_dim=16, mlp_only_layers=[1])),
    "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM,
                  dict(intermediate_size=96, moe_intermediate_size=32, num_experts=4,
                       num_experts_per_tok=2, shared_expert_intermediate_size=48)),
}


def make_moe(name, path, common: dict = COMMON, **overrides):
    """A tiny random transformers MoE model of family `name` (config fields `overrides`
    changed), saved with safetensors at `path`; routers drawn wide so that tokens spread over
    the experts."""
    cfg_cls, model_cls, extra = MOE[name]
    extra = {**extra, **overrides}
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**common, **extra)).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "bias" in n or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            if n.endswith("gate.weight") and "proj" not in n:  # the routers
                p.normal_(0, 0.5)
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer_from_gguf(embedded_model_path()).save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=sorted(MOE))
def moe(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, make_moe(request.param, path), path


def test_logits_and_parameter_counts_match_transformers(moe):
    name, hf, path = moe
    ckpt = load_hf_dir(str(path))
    mc = ModelConfig.from_hf_config(ckpt.config)
    assert mc.num_experts and mc.moe_layers == ((0, 2) if name == "qwen3_moe" else (0, 1, 2))
    assert mc.num_params() == sum(p.numel() for p in hf.parameters())
    assert mc.num_params(active=True) < mc.num_params()
    model = LlamaModel(mc)
    assert_logits_match(hf, model, params_from_tensors(model, ckpt.tensors), mc,
                        COMMON["vocab_size"], 1e-4, name)


def test_one_generate_with_every_engine_feature_gives_transformers_tokens(moe):
    name, hf, path = moe
    assert_generate_with_every_feature_matches(hf, path, COMMON["vocab_size"], name)


def test_plan_counts_total_and_active_params(tmp_path):
    import os
    import subprocess
    import sys
    hf = make_moe("qwen2_moe", tmp_path)
    r = subprocess.run([sys.executable, "-m", "jaxkv.cli", "plan", "--model", str(tmp_path),
                        "--json", "--max-model-len", "128"], capture_output=True, text=True,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"}, timeout=300)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)
    assert plan["num_params"] == sum(p.numel() for p in hf.parameters())
    assert plan["weights_bytes"] == 4 * plan["num_params"] and plan["num_active_params"] < plan["num_params"]


def test_what_moe_models_refuse(tmp_path):
    make_moe("mixtral", tmp_path)
    mc = ModelConfig.from_hf_config(load_hf_dir(str(tmp_path), load_weights=False).config)
    assert EngineArgs(quantization="fp8", tensor_parallel_size=2).create_engine_config(
        platform="cpu", model_config=mc).runner.quantization.method == "fp8"
    awq = {"quant_method": "awq", "bits": 4, "group_size": 16, "zero_point": True, "version": "gemm"}
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 must divide the 3 input groups "
                                         r"of experts.down_proj"):  # each expert's 48 rows cut
        EngineArgs(tensor_parallel_size=2).create_engine_config(
            platform="cpu", model_config=mc, quantization_config=awq)
    assert EngineArgs(tensor_parallel_size=2, enable_expert_parallel=True).create_engine_config(
        platform="cpu", model_config=mc, quantization_config=awq).runner.quantization.method == "awq"
    assert EngineArgs(quantization="fp8").create_engine_config(
        platform="cpu", model_config=mc).runner.quantization.method == "fp8"
    gguf = {"quant_method": "gguf", "tensor_types": {"blk.0.attn_q.weight": "Q8_0"}}
    with pytest.raises(ValueError, match="quantized experts .* in GGUF blocks are not kept yet"):
        EngineArgs(quantization="gguf").create_engine_config(
            platform="cpu", model_config=mc, quantization_config=gguf)
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        EngineArgs(tensor_parallel_size=3).create_engine_config(platform="cpu", model_config=mc)
    import dataclasses
    six = dataclasses.replace(mc, num_experts=6)
    with pytest.raises(ValueError, match=r"enable_expert_parallel: tensor_parallel_size 4 must "
                                         r"divide num_experts \(6\)"):
        EngineArgs(enable_expert_parallel=True, tensor_parallel_size=4).create_engine_config(
            platform="cpu", model_config=six)
    from jaxkv.loader.source import read_config
    dense = ModelConfig.from_hf_config(read_config(None))
    with pytest.raises(ValueError, match="enable_expert_parallel: LlamaForCausalLM has no experts"):
        EngineArgs(enable_expert_parallel=True).create_engine_config(platform="cpu", model_config=dense)


def write_moe_gguf(hf, name, folder, path):
    """The transformers model `hf` of family `name`, saved at `folder`, written as llama.cpp
    writes it: Mixtral as
    "llama" with an expert count (q/k rows permuted), Qwen2-MoE as "qwen2moe" (q/k/v biases, the
    shared expert as ffn_*_shexp, its gate a vector), Qwen3-MoE as "qwen3moe"; routers as
    ffn_gate_inp, each layer's experts stacked [experts, out, in] as ffn_{gate,up,down}_exps."""
    import gguf

    from tests.loader.test_gguf import llama_cpp_permute
    c = hf.config
    arch = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[name]
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers), w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_vocab_size(c.vocab_size)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    w.add_key_length(head_dim), w.add_value_length(head_dim)
    num_experts = getattr(c, "num_local_experts", None) or c.num_experts
    w.add_expert_count(num_experts), w.add_expert_used_count(c.num_experts_per_tok)
    if name != "mixtral":
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
    if name == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    from jaxkv.loader.hf import load_hf_tensors  # the saved (per-expert) tensors
    sd = {k: np.asarray(v, np.float32) for k, v in load_hf_tensors(folder).items()}
    moe = "block_sparse_moe" if name == "mixtral" else "mlp"
    experts = {"gate": ("w1", "gate_proj"), "up": ("w3", "up_proj"), "down": ("w2", "down_proj")}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    leaves = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", f"{moe}.gate": "ffn_gate_inp",
              "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
              "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
              "mlp.shared_expert.down_proj": "ffn_down_shexp"}
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        for hf_leaf, g in leaves.items():
            for kind in ("weight", "bias"):
                names[f"{p}{hf_leaf}.{kind}"] = f"blk.{i}.{g}.{kind}"
        for g, (mixtral, qwen) in experts.items():
            leaf = mixtral if name == "mixtral" else qwen
            if f"{p}{moe}.experts.0.{leaf}.weight" not in sd:
                continue  # a dense layer (Qwen3-MoE's mlp_only_layers)
            stack = [sd.pop(f"{p}{moe}.experts.{e}.{leaf}.weight") for e in range(num_experts)]
            w.add_tensor(f"blk.{i}.ffn_{g}_exps.weight", np.ascontiguousarray(np.stack(stack)))
    for k, v in sd.items():
        g = names[k]
        if arch == "llama" and g.split(".")[-2] in ("attn_q", "attn_k"):
            v = llama_cpp_permute(v, c.num_attention_heads if "attn_q" in g else c.num_key_value_heads)
        if g.endswith("ffn_gate_inp_shexp.weight"):  # llama.cpp's: a vector [hidden]
            v = v.reshape(-1)
        w.add_tensor(g, np.ascontiguousarray(v))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_a_gguf_file_gives_the_folders_tensors_and_tokens(name, tmp_path):
    hf = make_moe(name, tmp_path / "hf", mlp_only_layers=[])  # llama.cpp's qwen3moe: all MoE
    write_moe_gguf(hf, name, tmp_path / "hf", tmp_path / "m.gguf")
    from jaxkv.loader.gguf import load_gguf
    from jaxkv.loader.hf import load_hf_tensors
    ours = load_gguf(tmp_path / "m.gguf", with_tokenizer=False).tensors
    theirs = load_hf_tensors(tmp_path / "hf")
    assert set(ours) == set(theirs)  # every expert of every layer, q/k rows un-permuted
    for k, v in theirs.items():
        assert np.array_equal(ours[k], np.asarray(v, np.float32)), k
    assert_gguf_gives_the_folders_tokens(tmp_path / "hf", tmp_path / "m.gguf", COMMON["vocab_size"], name)


def test_missing_moe_keys_take_transformers_defaults():
    base = dict(COMMON, intermediate_size=96)
    mc = ModelConfig.from_hf_config({**base, "architectures": ["Qwen2MoeForCausalLM"]})
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size,
            mc.shared_expert_intermediate_size) == (60, 4, 1408, 5632)
    mc = ModelConfig.from_hf_config({**base, "architectures": ["Qwen3MoeForCausalLM"]})
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size) == (128, 8, 768)
    with pytest.raises(ValueError, match="num_experts_per_tok 9 must be between 1 and the 8 experts"):
        ModelConfig.from_hf_config({**base, "architectures": ["Qwen3MoeForCausalLM"],
                                    "num_experts": 8, "num_experts_per_tok": 9})


@pytest.mark.parametrize("steps", [1, 4])
def test_the_experts_load_is_counted(moe, steps):
    """stats() counts the real tokens each expert took (padding rows excluded), summed over the
    MoE layers: every computed token k times per MoE layer; the imbalance is max / mean. With
    multi-step decode (num_scheduler_steps 4) the same: a k-step program adds up its
    iterations, a sequence's rows past its steps left out."""
    from jaxkv import LLM, SamplingParams

    name, hf, path = moe
    llm = LLM(model=str(path), max_model_len=128, max_num_batched_tokens=64, token_buckets=(8, 64),
              kv_cache_memory_bytes=1 << 20, max_num_seqs=8, enable_prefix_caching=False,
              async_scheduling=False, num_scheduler_steps=steps)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, COMMON["vocab_size"], n).tolist() for n in (5, 11, 20)]
    llm.generate([{"prompt_token_ids": p} for p in prompts],
                 SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    s, mc = llm.stats(), llm.llm_engine.config.model_config
    computed = sum(len(p) for p in prompts) + 3 * (8 - 1)
    assert sum(s.moe_expert_tokens) == computed * mc.num_experts_per_tok * len(mc.moe_layers)
    assert len(s.moe_expert_tokens) == mc.num_experts
    assert s.moe_load_imbalance == max(s.moe_expert_tokens) / (sum(s.moe_expert_tokens) / mc.num_experts)
    assert s.moe_load_imbalance >= 1.0
    assert (s.num_multi_steps > 0) == (steps > 1)
