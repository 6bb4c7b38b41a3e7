"""The engine's Llama weights (jaxkv.models.llama's parameter tree) run densely in plain JAX,
for the baselines of kv_strategies.py: no paging, [batch, tokens] at a time, greedy.

  naive(stacked, params, ids, seg, pos, last): no KV cache; whole sequences packed into rows
      (seg numbers them, pos restarts at 0 in each), causal within each sequence; returns the
      next token of each sequence whose last token sits at last[i] = (row, column).
  prefill / decode: a dense cache per layer, (k, v) each [layers, batch, max_model_len,
      kv_heads, head_dim], donated, written with dynamic_update_slice; prompts left-padded;
      decode(span=S) attends over slots [0, S) only (S static: one program per span).
The layer math is the engine's: same RMSNorm (float32), rotate-half RoPE (jaxkv's apply_rope
on the engine's host tables, input_builder.rope_tables, looked up by position), grouped-query
attention, SwiGLU, tied logits (LlamaModel.logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG = -1e30  # additive mask: finite, so fully masked padding rows stay NaN-free


class Dense:
    """The engine's Llama weights run densely: [batch, tokens] at a time, no paging."""

    def __init__(self, model, params):
        import numpy as np

        from jaxkv.models.llama import apply_rope, rope_inv_freq
        from jaxkv.runner.input_builder import rope_tables
        from jaxkv.models.params import split_projections
        layers = {f"layers_{i}": split_projections(params[f"layers_{i}"], model.cfg)  # (fused on a GPU)
                  for i in range(model.cfg.num_layers)}
        params = {**params, **layers}
        self.c, self.model, self.params, self.rope = model.cfg, model, params, apply_rope
        # cos / sin [max_position_embeddings, head_dim / 2]: the same values as the engine's
        cos, sin = rope_tables(np.arange(model.cfg.max_position_embeddings), rope_inv_freq(model.cfg))
        self.cos, self.sin = jnp.asarray(cos), jnp.asarray(sin)
        self.stacked = jax.tree_util.tree_map(lambda *a: jnp.stack(a), *[
            params[f"layers_{i}"] for i in range(model.cfg.num_layers)])
        self.naive = jax.jit(self._naive)
        self.naive_exe = {}  # packed shape -> compiled naive program (kv_strategies compiles ahead)
        self.prefill = jax.jit(self._prefill, donate_argnums=(2,))
        self.decode = jax.jit(self._decode, donate_argnums=(2,), static_argnames=("span",))

    def _norm(self, x, w):
        xf = x.astype(jnp.float32)
        return w * (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + self.c.rms_norm_eps)).astype(x.dtype)

    @staticmethod
    def _lin(p, x):
        return x @ p["kernel"] + p["bias"] if "bias" in p else x @ p["kernel"]

    def _attend(self, q, k, v, bias):  # q [B,T,K,G,D], k/v [B,S,K,D], bias [B,T,S]
        s = jnp.einsum("btkgd,bskd->bkgts", q, k) * self.c.head_dim ** -0.5 + bias[:, None, None]
        return jnp.einsum("bkgts,bskd->btkgd", jax.nn.softmax(s, axis=-1), v)

    def _layer(self, p, x, cos, sin, attend):
        """One decoder layer on x [B, T, hidden]; attend(q, k, v) -> attention output."""
        c, (b, t, _) = self.c, x.shape
        kh, d = c.num_kv_heads, c.head_dim
        h = self._norm(x, p["input_layernorm"]["weight"])
        q = self.rope(self._lin(p["q_proj"], h).reshape(b * t, c.num_heads, d), cos, sin)
        k = self.rope(self._lin(p["k_proj"], h).reshape(b * t, kh, d), cos, sin)
        o = attend(q.reshape(b, t, kh, -1, d), k.reshape(b, t, kh, d), self._lin(p["v_proj"], h).reshape(b, t, kh, d))
        x = x + self._lin(p["o_proj"], o.reshape(b, t, -1))
        h = self._norm(x, p["post_attention_layernorm"]["weight"])
        return x + self._lin(p["down_proj"], jax.nn.silu(self._lin(p["gate_proj"], h)) * self._lin(p["up_proj"], h))

    def _embed(self, params, ids, pos):
        pos = pos.reshape(-1)
        return params["embed_tokens"]["embedding"][ids], self.cos[pos], self.sin[pos]

    def _run(self, params, ids, pos, attend, state):
        """Layers unrolled (as the engine's model); attend(layer, q, k, v, state) -> (out, state)."""
        x, cos, sin = self._embed(params, ids, pos)
        st = [state]
        for i in range(self.c.num_layers):
            def att(q, k, v, i=i):
                o, st[0] = attend(i, q, k, v, st[0])
                return o
            x = self._layer(params[f"layers_{i}"], x, cos, sin, att)
        return x, st[0]

    def _next(self, params, x):  # greedy token from hidden rows [B, H]
        from jaxkv.models.llama import LlamaModel
        h = self._norm(x, params["norm"]["weight"])
        return jnp.argmax(self.model.apply({"params": params}, h, method=LlamaModel.logits), -1)

    def _naive(self, stacked, params, ids, seg, pos, last):
        """ids [R, W]: whole sequences packed into rows, seg: 1, 2, ... per sequence (0 = pad);
        causal within each sequence. Layers run as a scan over stacked weights: compiles ~5x
        faster than unrolled, and costs nothing here because every step is compute-bound."""
        t = ids.shape[1]
        key = jnp.arange(t)
        bias = jnp.where((seg[:, None, :] == seg[:, :, None]) & (key[None, None] <= key[None, :, None]), 0.0, NEG)
        x, cos, sin = self._embed(params, ids, pos)
        x, _ = jax.lax.scan(lambda x, p: (self._layer(p, x, cos, sin, lambda q, k, v: self._attend(q, k, v, bias)),
                                          None), x, stacked)
        return self._next(params, x[last[:, 0], last[:, 1]])

    def _prefill(self, params, ids, cache, pad):  # ids [B, Tp] left-padded by pad [B]
        _b, t = ids.shape
        key = jnp.arange(t)
        bias = jnp.where((key[None, None] <= key[None, :, None]) & (key[None, None] >= pad[:, None, None]), 0.0, NEG)

        def attend(i, q, k, v, st):
            st = tuple(jax.lax.dynamic_update_slice(a, n[None], (i, 0, 0, 0, 0)) for a, n in zip(st, (k, v)))
            return self._attend(q, k, v, bias), st
        x, cache = self._run(params, ids, jnp.maximum(key[None] - pad[:, None], 0), attend, cache)
        return self._next(params, x[:, -1]), cache

    def _decode(self, params, tok, cache, pad, slot, *, span):  # writes slot, reads slots < span
        key = jnp.arange(span)
        bias = jnp.where((key[None] >= pad[:, None]) & (key[None] <= slot), 0.0, NEG)[:, None]

        def attend(i, q, k, v, st):
            st = tuple(jax.lax.dynamic_update_slice(a, n[None], (i, 0, slot, 0, 0)) for a, n in zip(st, (k, v)))
            return self._attend(q, st[0][i, :, :span], st[1][i, :, :span], bias), st
        x, cache = self._run(params, tok[:, None], (slot - pad)[:, None], attend, cache)
        return self._next(params, x[:, 0]), cache
