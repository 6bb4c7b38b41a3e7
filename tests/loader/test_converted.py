"""`jaxkv convert`: the embedded GGUF converted to params in an orbax checkpoint (plus config and
tokenizer files) loads back into exactly the same params, tokenizer and chat template, and an
engine on the folder generates what the embedded model does; bad folders fail in one line."""

import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxkv import LLM, SamplingParams
from jaxkv.loader.converted import PARAMS, convert, is_converted
from tests.conftest import TEST_ENGINE


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    import threading
    before = set(threading.enumerate())
    out = tmp_path_factory.mktemp("converted") / "smollm2"
    assert convert(None, str(out)) > 0
    # The synchronous checkpointer leaves no thread behind (the async one raced pytest's own).
    assert not [t for t in set(threading.enumerate()) - before if t.is_alive()]
    return str(out)


def test_engine_on_the_folder_is_the_embedded_model(folder, llm):
    assert is_converted(folder) and not is_converted(None)
    conv = LLM(model=folder, **TEST_ENGINE)
    a, b = llm.llm_engine.runner.params, conv.llm_engine.runner.params
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert x.dtype == y.dtype and np.array_equal(np.asarray(x), np.asarray(y))
    chat = [{"role": "user", "content": "Name a planet."}]
    tok_a, tok_b = llm.get_tokenizer(), conv.get_tokenizer()
    assert tok_a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        tok_b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    sp = SamplingParams(temperature=0, max_tokens=12)
    want = llm.chat(chat, sp, use_tqdm=False)[0].outputs[0]
    got = conv.chat(chat, sp, use_tqdm=False)[0].outputs[0]
    assert got.token_ids == want.token_ids and got.text == want.text


def test_bad_folders_fail_in_one_line(folder, tmp_path):
    with pytest.raises(ValueError, match="not empty"):
        convert(None, folder)
    p = subprocess.run([sys.executable, "-m", "jaxkv.cli", "convert", str(tmp_path / "x.gguf"),
                        str(tmp_path / "out")], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().startswith("jaxkv: error:") \
        and len(p.stderr.strip().splitlines()) == 1, p.stderr
    # A folder whose params do not fit the model (another model's config) names the folder.
    import shutil
    from jaxkv.loader.converted import restore_params
    from jaxkv.models.llama import LlamaModel
    from jaxkv.models.model_config import ModelConfig
    from jaxkv.loader.source import read_config
    cfg = dict(read_config(folder), num_hidden_layers=2)
    with pytest.raises(ValueError, match="cannot restore"):
        restore_params(folder, LlamaModel(ModelConfig.from_hf_config(cfg)))
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    shutil.rmtree(broken / PARAMS / "d")  # the array data gone
    with pytest.raises(ValueError, match="broken"):
        restore_params(str(broken), LlamaModel(ModelConfig.from_hf_config(read_config(folder))))
