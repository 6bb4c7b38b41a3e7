"""Hugging Face folder loader: tiny random Llama models saved by transformers (CPU, torch as reference)."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from jaxkv.loader.checkpoint_data import CONFIG_KEYS
from jaxkv.loader.hf import load_hf_dir, read_hf_config

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def tokenizer():
    """The SmolLM2 tokenizer built from the embedded GGUF (byte-level BPE + ChatML template)."""
    from jaxkv.loader.gguf import embedded_model_path
    from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf

    try:
        return tokenizer_from_gguf(embedded_model_path())
    except FileNotFoundError as e:
        pytest.skip(str(e))


def save_tiny_llama(folder, tokenizer, *, tie=False, dtype=torch.float32, **save_kwargs):
    """Save a 2-layer random LlamaForCausalLM (+ tokenizer) to `folder`; returns its state_dict."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         rope_theta=50000.0, tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).to(dtype)
    model.save_pretrained(folder, safe_serialization=True, **save_kwargs)
    tokenizer.save_pretrained(folder)
    return model.state_dict()


def test_fp32_tensors_config_and_tokenizer(tmp_path, tokenizer):
    state = save_tiny_llama(tmp_path, tokenizer)
    ck = load_hf_dir(tmp_path)
    assert set(ck.tensors) == set(state)
    for name, w in ck.tensors.items():
        assert w.dtype == np.float32 and np.array_equal(w, state[name].numpy()), name
    cfg = ck.config
    assert set(CONFIG_KEYS) <= set(cfg)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["rope_theta"]) == (16, 2, 50000.0)
    assert cfg["rope_scaling"] is None and cfg["attention_bias"] is False and cfg["tie_word_embeddings"] is False
    assert cfg == read_hf_config(tmp_path)
    messages = [{"role": "user", "content": "hi 🙂"}]
    assert ck.tokenizer("naïve café 12345")["input_ids"] == tokenizer("naïve café 12345")["input_ids"]
    assert ck.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_bf16_and_tied_embeddings(tmp_path, tokenizer):
    state = save_tiny_llama(tmp_path, tokenizer, tie=True, dtype=torch.bfloat16)
    ck = load_hf_dir(tmp_path)
    assert set(ck.tensors) == set(state) - {"lm_head.weight"} and ck.config["tie_word_embeddings"] is True
    for name, w in ck.tensors.items():
        assert w.dtype == ml_dtypes.bfloat16, name
        assert np.array_equal(w.astype(np.float32), state[name].float().numpy()), name


def test_sharded_checkpoint_and_no_weights(tmp_path, tokenizer):
    state = save_tiny_llama(tmp_path, tokenizer, max_shard_size="2MB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    ck = load_hf_dir(tmp_path)
    assert set(ck.tensors) == set(state)
    assert all(np.array_equal(ck.tensors[k], v.numpy()) for k, v in state.items())
    assert load_hf_dir(tmp_path, load_weights=False).tensors == {}


def test_config_defaults_from_rope_parameters(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 4,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}}))
    cfg = read_hf_config(tmp_path)
    assert (cfg["head_dim"], cfg["num_key_value_heads"], cfg["rope_theta"]) == (16, 4, 5e5)
    assert cfg["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0} and cfg["attention_bias"] is True


def test_errors(tmp_path, tokenizer):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="not found"):
        load_hf_dir(tmp_path / "missing")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                                                      "num_attention_heads": 4}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_hf_dir(tmp_path)
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        load_hf_dir(tmp_path, load_weights=False)
