"""Fixtures shared by the model tests."""

import pytest

from jaxkv.loader.converted import convert
from tests.models.test_architectures import make_hf


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """A tiny qwen2 checkpoint (q/k/v biases) and its converted folder: (checkpoint, converted)."""
    hf = tmp_path_factory.mktemp("qwen2")
    make_hf("qwen2", hf)
    out = tmp_path_factory.mktemp("converted") / "out"
    convert(str(hf), str(out))
    return str(hf), str(out)
