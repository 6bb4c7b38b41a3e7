"""Session-wide fixtures: the embedded model through jaxkv (a few engine configurations) and
through Hugging Face transformers (PyTorch, float32) as the reference."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")


def pytest_configure(config):
    """The engine's persistent compilation cache for every test, not only those that build an
    engine: the attention tests' programs are cache reads on a warm machine."""
    from jaxkv.engine.setup import enable_compilation_cache
    enable_compilation_cache()

# Short bucket lists keep compilation cheap; every engine below shares them, so the persistent
# compilation cache turns later engines' warmups into cache reads. The pool, max_model_len and
# max_num_seqs equal those of the shared test server (tests/serve/conftest.py), so the step and
# sampler programs of its buckets 8 and 64, compiled while the first tests run, are cache reads.
TEST_ENGINE = dict(max_model_len=1024, max_num_batched_tokens=256, token_buckets=(8, 64, 256),
                   max_num_seqs=32, kv_cache_memory_bytes=128 << 20)


def pytest_collection_finish(session):
    """Start the shared `jaxkv serve` of tests/serve now if any collected test needs it: its
    warmup runs in its own process while the tests before it run (2 cores, and compiling is
    mostly single-threaded)."""
    if any("server" in getattr(item, "fixturenames", ()) for item in session.items):
        from tests.serve.conftest import launch_server
        launch_server()


@pytest.fixture(scope="session")
def gguf_path():
    from jaxkv.loader.gguf import embedded_model_path
    return embedded_model_path()


@pytest.fixture(scope="session")
def llm():
    """The embedded SmolLM2 in float32 with prefix caching on and an ample pool."""
    from jaxkv import LLM
    return LLM(**TEST_ENGINE)


@pytest.fixture(scope="session")
def llm_no_prefix_cache():
    from jaxkv import LLM
    return LLM(enable_prefix_caching=False, **TEST_ENGINE)


@pytest.fixture(scope="session")
def hf_smollm2(gguf_path):
    """transformers' LlamaForCausalLM from the same GGUF, float32, eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    folder, name = os.path.split(gguf_path)
    return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
