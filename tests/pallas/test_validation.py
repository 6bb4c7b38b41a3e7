"""Every ValueError path of the kernel wrappers fires, with a message naming the argument
(shapes, dtypes, and the Triton lowering's rules: power-of-two block shapes, dot dims >= 16)."""

import jax.numpy as jnp
import pytest

from pallas_kernels import paged_attention, ragged_paged_attention


def good(heads=4, kvh=2, d=64, bs=16, dtype=jnp.float32, layers=None, tokens=5, seqs=3):
    pool = (4, bs, kvh, d) if layers is None else (layers, 4, bs, kvh, d)
    return dict(q=jnp.zeros((tokens, heads, d), dtype), k_cache=jnp.zeros(pool, dtype),
                v_cache=jnp.zeros(pool, dtype), block_tables=jnp.zeros((seqs, 2), jnp.int32),
                seq_lens=jnp.ones(seqs, jnp.int32),
                query_start_loc=jnp.array([0, 1, 2, 5][:seqs + 1], jnp.int32),
                num_seqs=jnp.array([seqs], jnp.int32))


def ragged(args, **kw):
    a = dict(args)
    return ragged_paged_attention(a.pop("q"), a.pop("k_cache"), a.pop("v_cache"),
                                  a.pop("block_tables"), a.pop("seq_lens"),
                                  a.pop("query_start_loc"), a.pop("num_seqs"),
                                  **{"scale": 0.125, "interpret": True, **kw})


def decode(args, **kw):
    return paged_attention(args["q"][:args["block_tables"].shape[0]], args["k_cache"], args["v_cache"],
                           args["block_tables"], args["seq_lens"], **{"scale": 0.125, "interpret": True, **kw})


def with_(**over):
    a = good()
    a.update(over)
    return a


COMMON = [  # (arguments, extra keywords, name the message must contain)
    (with_(q=jnp.zeros((5, 4 * 64))), {}, "q must be"),
    (with_(q=jnp.zeros((5, 4, 64), jnp.int32)), {}, "q must be float32"),
    (with_(k_cache=jnp.zeros((4, 16, 2))), {}, "k_cache"),
    (with_(v_cache=jnp.zeros((4, 16, 2, 32))), {}, "v_cache"),
    (with_(k_cache=jnp.zeros((4, 16, 2, 64), jnp.bfloat16)), {}, "k_cache and v_cache"),
    (with_(q=jnp.zeros((5, 4, 32))), {}, "head_dim"),
    (good(d=8), {}, "head_dim must be a power of two >= 16"),
    (good(d=48), {}, "head_dim must be a power of two >= 16"),
    (good(heads=3), {}, "num_q_heads"),
    (good(layers=2), {}, "layer is required"),
    (good(layers=2), {"layer": 2}, "layer must be in"),
    (good(layers=2), {"layer": jnp.zeros(2, jnp.int32)}, "layer must be"),
    (good(), {"layer": 0}, "layer must be None"),
    (with_(block_tables=jnp.zeros((3, 2), jnp.float32)), {}, "block_tables"),
    (with_(block_tables=jnp.zeros(3, jnp.int32)), {}, "block_tables"),
    (with_(seq_lens=jnp.ones((3, 1), jnp.int32)), {}, "seq_lens"),
    (with_(seq_lens=jnp.ones(2, jnp.int32)), {}, "seq_lens must have"),
    (good(), {"scale": 0.0}, "scale"),
    (good(), {"scale": "x"}, "scale"),
    (good(), {"block_k": 8}, "block_k"),
    (good(), {"block_k": 48}, "block_k"),
    (good(), {"num_warps": 3}, "num_warps"),
    (good(), {"num_stages": 0}, "num_stages"),
]


@pytest.mark.parametrize("args,kw,name", COMMON)
@pytest.mark.parametrize("fn", [ragged, decode], ids=["ragged", "decode"])
def test_common_errors_name_the_argument(fn, args, kw, name):
    with pytest.raises(ValueError, match=name):
        fn(args, **kw)


@pytest.mark.parametrize("args,kw,name", [
    (with_(query_start_loc=jnp.array([0, 1, 2], jnp.int32)), {}, "query_start_loc must have"),
    (with_(query_start_loc=jnp.array([0, 1, 2, 5], jnp.float32)), {}, "query_start_loc"),
    (with_(num_seqs=jnp.array([3, 0], jnp.int32)), {}, "num_seqs must have shape"),
    (with_(num_seqs=jnp.int32(3)), {}, "num_seqs"),
    (good(), {"block_m": 8}, "block_m"),
    (good(), {"block_m": 24}, "block_m"),
    (good(heads=64, kvh=2), {"block_m": 16}, "block_m must be >= the query group size 32"),
])
def test_ragged_errors_name_the_argument(args, kw, name):
    with pytest.raises(ValueError, match=name):
        ragged(args, **kw)


@pytest.mark.parametrize("kw,name", [({"num_splits": 0}, "num_splits")])
def test_decode_errors_name_the_argument(kw, name):
    with pytest.raises(ValueError, match=name):
        decode(good(), **kw)


def test_decode_needs_one_row_per_sequence():
    a = good()
    with pytest.raises(ValueError, match="q must have one row per sequence"):
        paged_attention(a["q"], a["k_cache"], a["v_cache"], a["block_tables"], a["seq_lens"],
                        scale=0.125, interpret=True)


def test_valid_arguments_pass():
    """The baseline of every case above is accepted (so each error comes from its one change)."""
    for layers, kw in ((None, {}), (2, {"layer": 1})):
        args = good(layers=layers)
        assert ragged(args, **kw).shape == (5, 4, 64)
        assert decode(args, **kw).shape == (3, 4, 64)
