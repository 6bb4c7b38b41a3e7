"""RoPE: the host's rotary tables (input_builder.rope_tables) and the model's apply_rope
against transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb, at long positions and with
llama3 scaling; and the tables of a built StepInput (padding rows at position 0)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from jaxkv.core.scheduler_output import ScheduledRequest, SchedulerOutput
from jaxkv.models.llama import apply_rope, rope_inv_freq
from jaxkv.models.model_config import ModelConfig
from jaxkv.runner.input_builder import build_step_input, rope_tables
from jaxkv.sampling.params import SamplingParams

SCALINGS = {
    "plain": dict(rope_theta=10000.0),
    "llama3": dict(rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=1024)),
}


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_matches_transformers(name):
    hf = transformers.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=16384, **SCALINGS[name])
    cfg = ModelConfig.from_hf_config(hf.to_dict())
    rng = np.random.default_rng(0)
    pos = np.concatenate([np.arange(8), rng.integers(0, 16384, 56)]).astype(np.int32)
    x = rng.standard_normal((len(pos), 4, 64)).astype(np.float32)
    emb = LlamaRotaryEmbedding(config=hf)
    xt = torch.from_numpy(x).transpose(0, 1)[None]  # [1, heads, T, D]
    c, s = emb(xt, torch.from_numpy(pos.astype(np.int64))[None])
    hf_cos, hf_sin = c[0, :, :32].numpy(), s[0, :, :32].numpy()
    np.testing.assert_array_equal(hf_cos, c[0, :, 32:].numpy())  # the halves repeat

    # The tables: the same float32 angle (to an ulp of inv_freq), cos/sin of it.
    inv = rope_inv_freq(cfg)
    np.testing.assert_allclose(inv, emb.inv_freq.numpy(), rtol=2e-7)
    cos, sin = rope_tables(pos, inv)
    assert cos.shape == sin.shape == (len(pos), 32) and cos.dtype == np.float32
    tol = pos[:, None] * inv[None] * 3e-7 + 1e-6  # an ulp or two of the angle, in radians
    assert (np.abs(cos - hf_cos) <= tol).all() and (np.abs(sin - hf_sin) <= tol).all()

    # The rotation, given the same tables: transformers' apply_rotary_pos_emb to float32.
    ref, _ = apply_rotary_pos_emb(xt, xt, c, s)
    ref = ref[0].transpose(0, 1).numpy()
    ours = np.asarray(apply_rope(jnp.asarray(x), jnp.asarray(hf_cos), jnp.asarray(hf_sin)))
    np.testing.assert_allclose(ours, ref, rtol=0, atol=2e-6)
    assert np.abs(ours - x).max() > 0.1  # it rotated


def test_step_input_rope_tables():
    inv = rope_inv_freq(ModelConfig.from_hf_config(transformers.LlamaConfig(
        hidden_size=128, num_attention_heads=2, num_key_value_heads=1).to_dict()))
    sp = SamplingParams()
    out = SchedulerOutput([ScheduledRequest("a", [5, 6, 7], 10, [1], True, sp, 0, 0, 0),
                           ScheduledRequest("b", [8], 40, [2, 3, 4], True, sp, 1, 0, 0)])
    si = build_step_input(out, block_size=16, num_tokens=8, rows=4, max_blocks=4,
                          rope_table=rope_tables(np.arange(64), inv))
    np.testing.assert_array_equal(si.positions[:4], [10, 11, 12, 40])
    cos, sin = rope_tables(si.positions[:4], inv)
    np.testing.assert_array_equal(si.rope_cos[:4], cos)
    np.testing.assert_array_equal(si.rope_sin[:4], sin)
    np.testing.assert_allclose(si.rope_cos[1], np.cos(11 * inv.astype(np.float64)), atol=1e-6)
    np.testing.assert_array_equal(si.rope_cos[4:], 1.0)  # padding rows: position 0
    np.testing.assert_array_equal(si.rope_sin[4:], 0.0)
