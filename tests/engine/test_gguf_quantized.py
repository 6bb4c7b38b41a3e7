"""--quantization gguf: a GGUF file's Q8_0 / Q4_0 / Q4_1 blocks kept as they are (the layers'
linear weights and the embedding, which is also the tied LM head), dequantized inside the
step. The kept blocks give exactly gguf's own dequantized values; tiny Llama files written
here in each type give the float path's logits (within 1e-3 relative) and tokens; the
embedded model holds under a quarter of its float32 bytes and writes the float path's greedy
outputs but at near-ties."""

from __future__ import annotations

import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.loader.gguf import embedded_model_path, load_gguf
from jaxkv.quantization import resolve
from jaxkv.quantization.gguf import GGUFBlocks
from tests.conftest import TEST_ENGINE
from tests.engine.test_kv_cache_dtype import (_divergences, first_token_diffs,  # noqa: F401
                                              reference)
from tests.loader.test_gguf import write_tiny_gguf

FLOAT32_BYTES = 134_515_008 * 4  # SmolLM2-135M's parameters in float32


def test_kept_blocks_are_ggufs_values():
    """Every tensor kept (Q4_1 layers, the Q8_0 embedding, q/k rows un-permuted) dequantizes to
    exactly what the float load (gguf.quants.dequantize) gives."""
    path = embedded_model_path()
    kept = load_gguf(path, with_tokenizer=False, keep_quantized=True).tensors
    floats = load_gguf(path, with_tokenizer=False).tensors
    blocks = {n: t for n, t in kept.items() if isinstance(t, GGUFBlocks)}
    assert len(blocks) == 30 * 7 + 1
    assert {b.kind for b in blocks.values()} == {"Q4_1", "Q8_0"}
    for name, b in blocks.items():
        assert np.array_equal(b.dequantize(), floats[name]), name


def _quantized_writer(kind):
    """Hook for write_tiny_gguf: every linear weight and the embedding written as `kind`."""
    import gguf

    def add(writer, name, w):
        if name.endswith(".weight") and w.ndim == 2:
            k = gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, gguf.quants.quantize(w, k), raw_dtype=k)
            return True
        return False
    return add


@pytest.fixture(scope="module", params=["Q4_0", "Q4_1", "Q8_0"])
def tiny_file(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param) / "m.gguf"
    write_tiny_gguf(path, "llama", tied=True, add_tensor=_quantized_writer(request.param))
    return request.param, str(path)


ENGINE = dict(tokenizer=embedded_model_path(), max_model_len=128, max_num_batched_tokens=64, token_buckets=(8, 64),
              kv_cache_memory_bytes=1 << 20, max_num_seqs=8)


def test_tiny_files_give_the_float_paths_logits_and_tokens(tiny_file):
    kind, path = tiny_file
    kept, flat = LLM(model=path, quantization="gguf", **ENGINE), LLM(model=path, **ENGINE)
    s = kept.stats()
    assert s.quantization == "gguf" and s.weights_bytes < 0.35 * flat.stats().weights_bytes
    leaves = kept.llm_engine.runner.params["layers_0"]["q_proj"]
    assert set(leaves) == {"qweight", "scales", "mins"}
    assert leaves["qweight"].dtype == (np.int8 if kind == "Q8_0" else np.uint8)
    rng = np.random.default_rng(2)
    prompts = [{"prompt_token_ids": rng.integers(3, 128, n).tolist()} for n in (5, 9, 17, 30)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    a, b = (llm.generate(prompts, sp, use_tqdm=False) for llm in (kept, flat))
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids, kind
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            for t, lp in ly.items():
                assert abs(lx[t].logprob - lp.logprob) <= 1e-3 * max(1.0, abs(lp.logprob)), kind


def test_the_embedded_model_kept_quantized(reference):  # noqa: F811
    convs, sp, ref = reference
    llm = LLM(quantization="gguf", **TEST_ENGINE)
    s = llm.stats()
    assert s.weights_bytes <= 0.25 * FLOAT32_BYTES
    from jaxkv.loader.source import read_config
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.quantization import weights_bytes
    config = read_config(None)  # what jaxkv plan counts for the KV budget, within 1%
    planned = weights_bytes(ModelConfig.from_hf_config(config), 4, resolve("gguf", config, "cpu"))
    assert abs(planned - s.weights_bytes) < 0.01 * s.weights_bytes, (planned, s.weights_bytes)
    got = llm.chat(convs, sp, use_tqdm=False)
    margins = _divergences(got, ref)
    diffs = first_token_diffs(got, ref)
    print(f"\ngguf blocks kept: weights {s.weights_bytes / 2**20:.1f} MiB "
          f"({s.weights_bytes / FLOAT32_BYTES:.3f}x float32); {10 - len(margins)}/10 greedy "
          f"16-token outputs equal the float path's (float margins where they part: "
          f"{[round(m, 4) for m in margins]}); mean |first-token logprob difference| "
          f"{np.mean(diffs):.2e}")
    # The same weights bit for bit, summed in another order: outputs part only at near-ties.
    assert all(m < 0.01 for m in margins) and np.mean(diffs) < 1e-4


def test_what_gguf_blocks_need():
    config = load_gguf(embedded_model_path(), with_tokenizer=False).config
    spec = resolve("gguf", config, "cpu")
    assert (spec.bits, spec.group_size, spec.embedding_bits) == (4, 32, 8)
    assert resolve(None, config, "cpu") is None  # a GGUF file's default: float weights
    with pytest.raises(ValueError, match="needs a .gguf model file"):
        resolve("gguf", {}, "cpu")
    types = dict(config["quantization_config"]["tensor_types"], **{"blk.3.ffn_down.weight": "Q6_K"})
    with pytest.raises(ValueError, match="tensor blk.3.ffn_down.weight is Q6_K"):
        resolve("gguf", {"quantization_config": {"quant_method": "gguf", "tensor_types": types}}, "cpu")
    with pytest.raises(ValueError, match="does not match a GGUF file"):
        resolve("awq", config, "cpu")
