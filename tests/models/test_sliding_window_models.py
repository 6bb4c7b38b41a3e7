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
from tests.models.hf_compare import assert_generate_with_every_feature_matches, assert_logits_match

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


def make_windowed(name, path):
    cfg_cls, model_cls, extra = WINDOWED[name]
    torch.manual_seed(0)
    hf = model_cls(cfg_cls(**COMMON, **extra, attn_implementation="eager")).eval()
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
    assert_generate_with_every_feature_matches(hf, path, COMMON["vocab_size"], name)


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
