"""The C++ greedy argmax (jaxkv/cpu_kernels/argmax.py) called directly: jnp.argmax's result
for row lengths on and off its 16-lane vectors (a tail only, lanes only, both) and more rows
than threads; an unbuilt kernel is a RuntimeError naming why. Ties, infinities and NaNs go
through sampler.argmax_tokens(cpu=True) in tests/sampling/test_sampler.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxkv.cpu_kernels import argmax as cpu_argmax

ARGMAX = jax.jit(cpu_argmax.argmax)


@pytest.mark.parametrize("rows,v", [(1, 1), (3, 15), (2, 16), (5, 17), (9, 300), (64, 4099)])
def test_matches_jnp_argmax(rows, v):
    rng = np.random.default_rng(rows * 100 + v)
    x = jnp.asarray(rng.standard_normal((rows, v)).astype(np.float32))
    got = np.asarray(ARGMAX(x))
    assert got.dtype == np.int32 and got.shape == (rows,)
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(x, axis=-1)))


def test_an_unbuilt_kernel_is_an_error(monkeypatch):
    monkeypatch.setattr(cpu_argmax, "load", lambda: None)
    monkeypatch.setattr(cpu_argmax, "build_error", lambda: "no C++ compiler found")
    with pytest.raises(RuntimeError, match="cpu argmax kernel unavailable: no C\\+\\+ compiler"):
        cpu_argmax.argmax(jnp.zeros((2, 8)))
