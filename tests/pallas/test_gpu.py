"""The kernels compiled natively (interpret=False) on a GPU, against the float32 reference.
Marked `gpu`; skipped where JAX sees no GPU device. Run them with JAX_PLATFORMS=cuda (the
tests force the CPU otherwise). The checks live in native_checks.py, which also runs without
pytest on the device."""

import jax
import pytest

from tests.pallas.native_checks import DECODE, RAGGED, check_decode, check_ragged


def _has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not _has_gpu(), reason="no GPU device")]


@pytest.mark.parametrize("index,case", list(enumerate(RAGGED)), ids=[c.id for c in RAGGED])
def test_ragged_native(index, case):
    check_ragged(index, case)


@pytest.mark.parametrize("index,case", list(enumerate(DECODE)), ids=[c.id for c in DECODE])
def test_decode_native(index, case):
    check_decode(index, case)
