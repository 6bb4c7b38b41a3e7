"""Sliding-window models against transformers, float32: a tiny Mistral whose every layer has
a window shorter than the prompts (Mistral 7B v0.1's scheme), a tiny Qwen2 with windowed
and global layers mixed (transformers' layer_types), a tiny Gemma 2 (local and global
layers alternating, attention and final logit soft-capping made strong enough to matter,
query_pre_attn_scalar, GeGLU, (1 + w) norms before and after attention and MLP, the
embedding scaled by sqrt(hidden)) and a tiny Gemma 3 (q/k norms, two local layers to one
global, the local layers' RoPE base apart from the global one's linear-scaled one). Logits within 1e-4 relative through
prefill, chunks and decode, on the xla and cpu backends (the cpu backend's windowed layers
take the XLA path); greedy tokens equal through one LLM.generate with prefix caching,
chunked prefill, preemption, n=2 and speculative decoding."""

from __future__ import annotations

import pytest
import torch
import transformers

from jaxkv.loader.gguf import embedded_model_path
from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
from jaxkv.loader.hf import load_hf_dir
from jaxkv.models.llama import LlamaModel
from jaxkv.models.model_config import ModelConfig
from jaxkv.models.params import params_from_tensors
from tests.models.hf_compare import (assert_generate_with_every_feature_matches,
                                      assert_gguf_gives_the_folders_tokens, assert_logits_match,
                                      greedy_reference)

COMMON = dict(vocab_size=211, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5)
WINDOWED = {
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(sliding_window=7, head_dim=16)),
    "qwen2_mixed": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                    dict(use_sliding_window=True, sliding_window=9, max_window_layers=3,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM,
               dict(sliding_window=6, head_dim=16, query_pre_attn_scalar=24,
                    attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM,
               dict(sliding_window=5, head_dim=16, query_pre_attn_scalar=24,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 100000.0},
                                     "sliding_attention": {"rope_type": "default",
                                                           "rope_theta": 100.0}})),
}
WINDOWS = {"mistral": (7, 7, 7), "qwen2_mixed": (9, None, 9), "gemma2": (6, None, 6),
           "gemma3": (5, 5, None)}


def make_windowed(name, path, **overrides):
    cfg_cls, model_cls, extra = WINDOWED[name]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**COMMON, **{**extra, **overrides}, attn_implementation="eager")).eval()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "bias" in n or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            if name.startswith("gemma") and "proj" in n:  # scores and logits large enough to matter
                p.mul_(4.0)
    hf.save_pretrained(path, safe_serialization=True)
    tokenizer_from_gguf(embedded_model_path()).save_pretrained(path)
    return hf


@pytest.fixture(scope="module", params=sorted(WINDOWED))
def windowed(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    return request.param, make_windowed(request.param, path), path


@pytest.mark.parametrize("backend", ["xla", "cpu"])
def test_logits_match_transformers(windowed, backend):
    from jaxkv.attention import get_attention
    name, hf, path = windowed
    ckpt = load_hf_dir(str(path))
    mc = ModelConfig.from_hf_config(ckpt.config)
    assert tuple(mc.window(i) for i in range(3)) == WINDOWS[name]
    assert mc.num_params() == sum(p.numel() for p in hf.parameters())
    model = LlamaModel(mc, attention=get_attention(backend))
    assert_logits_match(hf, model, params_from_tensors(model, ckpt.tensors), mc,
                        COMMON["vocab_size"], 1e-4, name)


def test_one_generate_with_every_engine_feature_gives_transformers_tokens(windowed):
    name, hf, path = windowed
    # Mistral frees blocks behind its window: a smaller pool for it to preempt too
    assert_generate_with_every_feature_matches(hf, path, COMMON["vocab_size"], name,
                                               num_blocks=7 if name == "mistral" else 14)


def test_configs_without_layer_types_get_transformers_windows():
    """Older configs say no layer_types (and Gemma 2's no tie_word_embeddings): the windowed
    layers and the tied head transformers derives from them."""
    base = dict(COMMON, num_hidden_layers=4, sliding_window=5)
    cases = {
        ("Qwen2ForCausalLM", "qwen2"): (dict(use_sliding_window=True, max_window_layers=1),
                                        (None, 5, 5, 5)),
        ("Qwen2MoeForCausalLM", "qwen2_moe"): (dict(use_sliding_window=True, max_window_layers=3),
                                               (5, None, 5, None)),
        ("Gemma2ForCausalLM", "gemma2"): ({}, (5, None, 5, None)),
        ("Gemma3ForCausalLM", "gemma3_text"): (dict(sliding_window_pattern=2), (5, None, 5, None)),
        ("MistralForCausalLM", "mistral"): ({}, (5, 5, 5, 5)),
    }
    for (arch, model_type), (extra, want) in cases.items():
        mc = ModelConfig.from_hf_config({**base, **extra, "architectures": [arch],
                                         "model_type": model_type})
        assert tuple(mc.window(i) for i in range(4)) == want, arch
    assert ModelConfig.from_hf_config({**base, "architectures": ["Gemma2ForCausalLM"]}).tie_word_embeddings
    for bad, match in ((dict(sliding_window=-3), "sliding_window must be a positive integer"),
                       (dict(attn_logit_softcapping=0), "attn_logit_softcapping must be positive")):
        with pytest.raises(ValueError, match=match):
            ModelConfig.from_hf_config({**base, **bad, "architectures": ["Gemma2ForCausalLM"]})


def test_a_gemma2_folder_without_tie_word_embeddings_loads_tied(tmp_path):
    import json
    make_windowed("gemma2", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    del cfg["tie_word_embeddings"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ckpt = load_hf_dir(str(tmp_path))
    assert ModelConfig.from_hf_config(ckpt.config).tie_word_embeddings


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_every_layer_windowed_frees_blocks_behind_the_window(tmp_path, async_scheduling):
    """Mistral (window 7, every layer) with blocks of 4 in a pool of 6 blocks (24 tokens):
    a 30-token prompt (chunked by the 8-token budget) and 40 decoded tokens, 70 in all, run
    in it because the blocks behind the window are freed as the sequence advances. After
    every step the block pool holds only the blocks of the last window (read from it); the
    tokens equal transformers'; at the end every block is free."""
    from jaxkv import LLM, SamplingParams

    hf = make_windowed("mistral", tmp_path)
    llm = LLM(model=str(tmp_path), max_model_len=128, max_num_batched_tokens=8, max_num_seqs=2, block_size=4,
              num_gpu_blocks_override=7, token_buckets=(1, 8), async_scheduling=async_scheduling)
    engine, kv = llm.llm_engine, llm.llm_engine.scheduler.kv
    prompt = torch.randint(3, COMMON["vocab_size"], (30,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_request("w", prompt, SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    most_held, out = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            out = o if o.finished else out
        blocks = kv.get_block_ids("w")
        held = [b for b in blocks if b]
        most_held = max(most_held, len(held))
        assert len(held) == kv.num_total_blocks - kv.num_free_blocks  # the pool agrees
        assert held == blocks[len(blocks) - len(held):]  # the freed ones lead the table
    assert most_held <= 4  # the window's 7 tokens and the chunk's 8 span at most 4 blocks
    s = llm.stats()
    assert s.kv_sliding_window == 7 and s.num_window_freed_blocks >= 13
    assert s.num_preemptions == 0 and kv.num_free_blocks == kv.num_total_blocks
    assert list(out.outputs[0].token_ids) == greedy_reference(hf, prompt, 40)
    # Run-ahead decode steps stay valid when a block behind the window is freed meanwhile.
    # (28 of 28 here; 19 when the freed block counted as a changed block table)
    assert s.num_async_steps_used >= (25 if async_scheduling else 0)
    assert s.num_async_steps_discarded == 0


def write_gemma_gguf(hf, folder, path, arch):
    """The transformers Gemma `hf`, saved at `folder`, written as llama.cpp writes it: norms
    as 1 + w, the norm before the MLP as ffn_norm, the ones after attention and MLP as
    post_attention_norm and post_ffw_norm, q/k rows not permuted, the LM head tied (absent);
    Gemma 3's windowed layers and local RoPE base in the newer per-layer keys."""
    import gguf
    import numpy as np

    from jaxkv.loader.hf import load_hf_tensors
    c = hf.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers), w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size), w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads), w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps), w.add_key_length(c.head_dim), w.add_value_length(c.head_dim)
    w.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(c.attn_logit_softcapping)
        w.add_final_logit_softcapping(c.final_logit_softcapping)
    else:
        rope = c.rope_parameters
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope["full_attention"]["factor"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in c.layer_types])
    leaves = {"input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
              "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
              "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    for i in range(c.num_hidden_layers):
        names.update({f"model.layers.{i}.{k}.weight": f"blk.{i}.{v}.weight" for k, v in leaves.items()})
    for k, v in load_hf_tensors(folder).items():
        v = np.asarray(v, np.float32)
        w.add_tensor(names[k], np.ascontiguousarray(v + 1 if "norm" in k else v))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_a_gemma_gguf_file_gives_the_folders_tensors_and_tokens(name, tmp_path):
    """Gemma 2 and 3 (its windowed layers and local RoPE base from the file's per-layer keys)
    written as llama.cpp writes them load transformers' tensors (the norms' w back from
    1 + w within float32 rounding) and give the folder's greedy tokens."""
    import numpy as np

    from jaxkv import LLM
    from jaxkv.loader.gguf import load_gguf
    from jaxkv.loader.hf import load_hf_tensors
    import dataclasses
    hf = make_windowed(name, tmp_path / "hf", query_pre_attn_scalar=16)  # llama.cpp's: head_dim
    write_gemma_gguf(hf, tmp_path / "hf", tmp_path / "m.gguf", name)
    g = load_gguf(tmp_path / "m.gguf", with_tokenizer=False)
    mc = ModelConfig.from_hf_config(g.config)
    assert tuple(mc.window(i) for i in range(3)) == WINDOWS[name]
    want = ModelConfig.from_hf_config(load_hf_dir(str(tmp_path / "hf"), load_weights=False).config)
    assert mc == dataclasses.replace(want, rms_norm_eps=mc.rms_norm_eps, bos_token_id=None,
                                     eos_token_ids=())  # the file has no tokenizer keys
    theirs = load_hf_tensors(tmp_path / "hf")
    assert set(g.tensors) == set(theirs)
    for k, v in theirs.items():
        assert np.allclose(g.tensors[k], np.asarray(v, np.float32), rtol=0, atol=1e-6), k
    assert_gguf_gives_the_folders_tokens(tmp_path / "hf", tmp_path / "m.gguf", COMMON["vocab_size"], name)
    with pytest.raises(ValueError, match=r"tokenizer.ggml.model None is not supported.*pass tokenizer="):
        LLM(model=str(tmp_path / "m.gguf"))  # no tokenizer of its own: one line says what to do


def test_gemma_gguf_keys_llama_cpp_leaves_out_take_its_defaults():
    """Soft-capping 50 / 30 for a Gemma 2 file that stores none; the query scale from
    head_dim, or hidden / heads for the 27B models (46 and 62 blocks); Gemma 3's local RoPE
    base 10000 and 1 global layer in 6."""
    from jaxkv.loader.gguf import _gemma_config
    meta = {"embedding_length": 128, "attention.head_count": 4, "attention.key_length": 16}

    def key_for(blocks):
        m = {**meta, "block_count": blocks}
        return lambda name, *default: m.get(name, *default) if default else m[name]
    small, big = _gemma_config("gemma2", key_for(42)), _gemma_config("gemma2", key_for(46))
    assert (small["attn_logit_softcapping"], small["final_logit_softcapping"]) == (50.0, 30.0)
    assert (small["query_pre_attn_scalar"], big["query_pre_attn_scalar"]) == (16, 32)
    g3 = _gemma_config("gemma3", key_for(62))
    assert g3["query_pre_attn_scalar"] == 32 and g3["attn_logit_softcapping"] is None
    assert (g3["rope_local_base_freq"], g3["sliding_window_pattern"]) == (10000.0, 6)
