"""vLLM's flags that a user brings along: --tokenizer, --chat-template, --trust-remote-code,
--enable-chunked-prefill (on; turning it off is refused in one line)."""

import json

import pytest

from jaxkv.chat_utils import load_chat_template
from jaxkv.cli import build_parser, main
from jaxkv.engine_args import EngineArgs


def test_flags_map_to_their_fields():
    ns = build_parser().parse_args(["serve", "--trust-remote-code", "--enable-chunked-prefill",
                                    "--tokenizer", "tok-dir", "--chat-template", "{{ x }}"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.trust_remote_code, args.enable_chunked_prefill, args.tokenizer) == (True, True, "tok-dir")
    assert EngineArgs().enable_chunked_prefill is None  # vLLM's default; None and True both mean on
    assert ns.chat_template == "{{ x }}"
    for cmd in (["generate", "hi"], ["plan"]):
        ns = build_parser().parse_args([*cmd, "--tokenizer", "t", "--trust-remote-code"])
        assert EngineArgs.from_cli_args(ns).tokenizer == "t"


def test_refused_and_bad_values_fail_in_one_line(capsys, tmp_path):
    with pytest.raises(ValueError, match="enable_chunked_prefill cannot be turned off"):
        EngineArgs(enable_chunked_prefill=False)
    assert main(["plan", "--no-enable-chunked-prefill"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("jaxkv: error: enable_chunked_prefill") and "\n" not in err
    assert main(["serve", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    err = capsys.readouterr().err.strip()
    assert "missing.jinja" in err and "neither a file nor an inline" in err and "\n" not in err
    assert main(["serve", "--tokenizer", str(tmp_path / "no-tok")]) == 2
    err = capsys.readouterr().err.strip()
    assert "no-tok" in err and "not found" in err and "\n" not in err


def test_chat_template_from_a_file_or_inline(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    assert load_chat_template(str(f)) == f.read_text()
    assert load_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    assert load_chat_template(None) is None


def test_server_renders_with_its_chat_template(llm):
    from serve.chat import chat_request_prompt
    from serve.protocol import ChatCompletionRequest

    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hello"}])
    tok = llm.get_tokenizer()
    own = chat_request_prompt(tok, req)
    mine = chat_request_prompt(tok, req, "<<{{ messages[0]['content'] }}>>")
    assert "<|im_start|>" in own["prompt"] and mine["prompt"] == "<<hello>>"
    assert mine["prompt_token_ids"] == tok.encode("<<hello>>", add_special_tokens=False)


def test_tokenizer_flag_replaces_the_models_tokenizer(tmp_path):
    from jaxkv import LLM, SamplingParams
    from jaxkv.chat_utils import render_chat
    from jaxkv.loader.gguf import embedded_model_path
    from jaxkv.loader.gguf_tokenizer import tokenizer_from_gguf
    from tests.runner.test_compilation import TINY_CONFIG, TINY_ENGINE

    model, other = tmp_path / "model", tmp_path / "tok"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY_CONFIG))
    tok = tokenizer_from_gguf(embedded_model_path())
    tok.save_pretrained(model)
    tok.chat_template = "<<{{ messages[0]['content'] }}>>"  # tells the two tokenizers apart
    tok.save_pretrained(other)
    engine = dict(TINY_ENGINE, warmup_token_buckets=None, token_buckets=(8, 32))
    plain = LLM(model=str(model), **engine)
    swapped = LLM(model=str(model), tokenizer=str(other), **engine)
    msg = [{"role": "user", "content": "hi"}]
    assert render_chat(plain.get_tokenizer(), msg)[0].startswith("<|im_start|>")
    assert render_chat(swapped.get_tokenizer(), msg)[0] == "<<hi>>"
    sp = SamplingParams(max_tokens=2, temperature=0)  # the engine still runs (ids < 512)
    assert len(swapped.generate({"prompt_token_ids": [5, 6, 7]}, sp, use_tqdm=False)[0].outputs[0].token_ids) == 2
    with pytest.raises(FileNotFoundError, match="tokenizer"):
        LLM(model=str(model), tokenizer=str(tmp_path / "nothing"), **engine)
