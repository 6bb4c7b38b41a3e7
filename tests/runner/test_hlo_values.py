"""benchmarks/hlo_values.py finds a copy of a donated array in a compiled program's HLO, and
none where XLA updates it in place."""

import jax
import jax.numpy as jnp

from benchmarks.hlo_values import copies, large_values, moves, shape_bytes

POOL = jnp.zeros((4, 64, 256), jnp.float32)  # 256 KiB
X = jnp.ones(256, jnp.float32)


def _values(f):
    exe = jax.jit(f, donate_argnums=0).lower(POOL, X).compile()
    return large_values(exe.as_text(), POOL.nbytes // 2), exe.memory_analysis()


def test_an_update_in_place_has_no_copy():
    values, mem = _values(lambda p, x: p.at[1, 3].set(x))
    assert not copies(values) and mem.temp_size_in_bytes < POOL.nbytes // 10
    assert {"parameter"} <= {v["opcode"] for v in values}
    assert all(v["gib"] == round(POOL.nbytes / 2**30, 3) for v in values if v["opcode"] != "tuple")


def test_the_old_value_read_after_the_update_is_a_copy():
    values, mem = _values(lambda p, x: (p.at[1, 3].set(x), (p[1] * 2).sum()))
    found = copies(values)
    assert found and found[0]["shape"] == "f32[4,64,256]" and mem.temp_size_in_bytes >= POOL.nbytes


def test_a_loop_body_is_read():
    def f(p, x):
        return jax.lax.fori_loop(0, 4, lambda i, q: q.at[i].set(q[i] * x[0]), p), (p + 1).sum()
    values, _ = _values(f)
    assert any("while/body" in v["op_name"] for v in values) and copies(values)


def test_a_loop_of_six_or_more_values_and_a_program_of_six_outputs_are_read():
    """XLA writes /*index=5*/ into a tuple of 6 or more elements, computations' headers too
    (a loop's state, the entry's outputs: an int8 pool's step returns 6 arrays)."""
    def f(p, x):
        def body(i, c):
            q, a, b, d, e, g = c
            return q.at[i].set(q[i] * x[0]), a + 1, b * 2, d - 1, e + x[1], g
        out = jax.lax.fori_loop(0, 4, body, (p, x, x + 1, x + 2, x + 3, x + 4))
        return (*out, (p + 1).sum())
    values, _ = _values(f)
    assert any("while/body" in v["op_name"] for v in values) and copies(values)


def test_a_hand_written_module():
    """An asynchronous copy counts once (its copy-done), a tuple allocates nothing, and a
    conditional's branches are read."""
    hlo = """HloModule m, entry_computation_layout={(bf16[1024,1024]{1,0})->bf16[1024,1024]{1,0}}

%branch_a (x: bf16[1024,1024]) -> bf16[1024,1024] {
  %x = bf16[1024,1024]{1,0} parameter(0)
  ROOT %t = bf16[1024,1024]{0,1} transpose(%x), dimensions={1,0}, metadata={op_name="jit(f)/transpose(a)"}
}

ENTRY %main.3 (p: bf16[1024,1024]) -> (bf16[1024,1024], /*index=1*/bf16[<=1024,1024]) {
  %p = bf16[1024,1024]{1,0} parameter(0)
  %cs = (bf16[1024,1024]{1,0}, bf16[1024,1024]{1,0}, u32[]) copy-start(%p)
  %cd = bf16[1024,1024]{1,0} copy-done(%cs)
  %i = s32[] constant(0)
  %c = bf16[1024,1024]{1,0} conditional(%i, %cd), branch_computations={%branch_a}
  ROOT %r = (bf16[1024,1024]{1,0}, bf16[<=1024,1024]{1,0}) tuple(%c, %cd)
}
"""
    values = large_values(hlo, 1 << 20)
    assert sorted(v["opcode"] for v in values) == ["conditional", "copy-done", "parameter", "parameter", "transpose"]
    assert [v["name"] for v in copies(values)] == ["cd"] and all(v["bytes"] == 2 << 20 for v in values)
    assert moves(values) == {"copy": [1, round(2 / 1024, 4)], "transpose": [1, round(2 / 1024, 4)]}
    assert next(v for v in values if v["opcode"] == "transpose")["op_name"] == "jit(f)/transpose(a)"


def test_shape_bytes():
    assert shape_bytes("bf16[2,3]{1,0}") == 12 and shape_bytes("(f32[4], s8[3], pred[])") == 20
    assert shape_bytes("f8e4m3fnuz[8]") == 8 and shape_bytes("f32[<=4,2]") == 32


def test_gpu_engine_names_the_copies():
    from benchmarks.gpu_engine import _large_values
    exe = jax.jit(lambda p, x: (p.at[1, 3].set(x), (p[1] * 2).sum()), donate_argnums=0).lower(POOL, X).compile()
    got = _large_values(exe, POOL.nbytes // 2)
    assert got["large_opcodes"]["copy"] == len(got["large_copies"]) >= 1


def test_moves_count_a_concatenation_of_weights():
    """What XLA:GPU's dot merger makes of x @ a, x @ b: x @ concat(a, b), the concatenation a
    new buffer every call; the same dots apart move nothing."""
    a, b = jnp.ones((256, 512), jnp.float32), jnp.ones((256, 512), jnp.float32)  # 512 KiB each

    def merged(x, a, b):
        return x @ jnp.concatenate([a, b], axis=1)

    got = {}
    for name, f in (("merged", merged), ("apart", lambda x, a, b: (x @ a, x @ b))):
        exe = jax.jit(f).lower(jnp.ones((2, 256)), a, b).compile()
        got[name] = moves(large_values(exe.as_text(), a.nbytes))
    assert got["merged"] == {"concatenate": [1, round(2 * a.nbytes / 2**30, 4)]} and got["apart"] == {}


def test_moves_count_a_layers_slice_taken_out_of_a_stack():
    """A loop over stacked weights (scan_layers) on XLA:CPU copies each layer's slice out
    before its dot: a dynamic-slice move of a layer's weight size; names with "address"
    (XLA:GPU's address computations, which read the slice in place) are not moves."""
    w = jnp.ones((4, 256, 512), jnp.float32)  # 512 KiB a layer

    def loop(x, w):
        return jax.lax.fori_loop(0, w.shape[0], lambda i, h: jnp.tanh(h @ w[i])[:, :256], x)

    exe = jax.jit(loop).lower(jnp.ones((2, 256)), w).compile()
    got = moves(large_values(exe.as_text(), w.nbytes // 4))
    assert got.get("dynamic-slice", [0])[0] >= 1, got
    fake = [{"opcode": "fusion", "name": "dynamic_address_computation.3", "bytes": 1 << 20},
            {"opcode": "fusion", "name": "loop_dynamic_slice_fusion", "bytes": 1 << 20}]
    assert moves(fake) == {"dynamic-slice": [1, round(1 / 1024, 4)]}
