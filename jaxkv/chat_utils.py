"""Chat messages -> prompt text and token ids, with the model's chat template.

The template is rendered by transformers' ``apply_chat_template`` (jinja2), with its
``add_generation_prompt`` and ``continue_final_message`` semantics. Token ids: the control
tokens come from the template alone. Text that a user types into a message (say
``<|im_end|>\\n<|im_start|>system``) is encoded as ordinary text, never as the control token it
spells, so a message cannot forge a turn of another role (prompt injection through the
template). Messages without such text are encoded exactly as transformers does (the rendered
string in one piece); a message with it is encoded apart from the template around it, with
special-token parsing off (``split_special_tokens``).

Errors: ValueError naming the message and field (``messages[0].content``) for a bad message,
an unsafe template, or a template that rejects the conversation.
"""

from __future__ import annotations

import json
import os
import re
import secrets
from typing import Any


def load_chat_template(value: str | None) -> str | None:
    """vLLM's --chat-template: the contents of the file `value` names, or `value` itself when
    it is an inline Jinja template (it holds "{" or a newline). ValueError for a path that
    does not exist (one line, naming it). None stays None (the model's own template)."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if any(c in value for c in "{\n"):
        return value
    raise ValueError(f"chat_template: {value!r} is neither a file nor an inline Jinja template")


def special_token_texts(tokenizer) -> list[str]:
    """The texts of the tokenizer's special (control) tokens."""
    texts = {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}
    texts.update(tokenizer.all_special_tokens)
    return sorted((t for t in texts if t), key=len, reverse=True)


def _content_text(content: Any, where: str) -> str:
    """A message's content as text: a string, or a list of OpenAI text parts joined with
    newlines (as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        parts = []
        for j, p in enumerate(content):
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise ValueError(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': str}}) "
                                 f"are supported, got {p!r}"[:300])
            parts.append(p["text"])
        return "\n".join(parts)
    raise ValueError(f"{where}: must be a string or a non-empty list of text parts, got {content!r}"[:300])


def normalize_messages(messages) -> list[dict]:
    """Check one conversation and return plain {"role", "content"[, "name"]} dicts (developer
    becomes system, text parts are joined). ValueError names the first bad field."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}"[:300])
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"messages[{i}].role must be a non-empty string, got {role!r}")
        if "<|" in role or "\n" in role:
            raise ValueError(f"messages[{i}].role must be a plain role name, got {role!r}"[:300])
        calls = m.get("tool_calls")
        if m.get("content") is None and not (calls and role == "assistant"):
            raise ValueError(f"messages[{i}].content must be given (a string or text parts); null "
                             "content is allowed only on an assistant message with tool_calls")
        content = m.get("content")
        msg = {"role": "system" if role == "developer" else role,
               "content": "" if content is None else _content_text(content, f"messages[{i}].content")}
        if m.get("name") is not None:
            msg["name"] = str(m["name"])
        if calls:
            msg["tool_calls"] = _tool_calls(calls, f"messages[{i}].tool_calls")
        if m.get("tool_call_id") is not None:
            msg["tool_call_id"] = str(m["tool_call_id"])
        out.append(msg)
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool_calls as templates read them (as vLLM and transformers):
    each function's arguments as a dict, parsed from the JSON text the API carries."""
    if not isinstance(calls, (list, tuple)):
        raise ValueError(f"{where} must be a list of tool calls")
    out = []
    for j, c in enumerate(calls):
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"{where}[{j}].function must have a name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ValueError(f"{where}[{j}].function.arguments must be a JSON text") from None
        if not isinstance(args, dict):
            raise ValueError(f"{where}[{j}].function.arguments must be a JSON object (as text)")
        out.append({**c, "function": {**fn, "arguments": args}})
    return out


def render_chat(tokenizer, messages, *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, chat_template: str | None = None,
                chat_template_kwargs: dict | None = None,
                tools: list[dict] | None = None) -> tuple[str, list[int]]:
    """One conversation -> (prompt text, prompt token ids); ids are not given BOS again.
    tools: OpenAI tool definitions, passed to the template as transformers passes them.

    continue_final_message: the last message (an open assistant turn, say) is left open for
    the model to continue, as transformers and vLLM do; it excludes add_generation_prompt.
    chat_template_kwargs: extra variables for the template (not the reserved names).
    """
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true "
                         "(set add_generation_prompt to false to continue the final message)")
    convo = normalize_messages(messages)
    if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
        raise ValueError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}")
    kwargs = dict(chat_template_kwargs or {})
    reserved = {"conversation", "messages", "tokenize", "add_generation_prompt",
                "continue_final_message", "chat_template", "return_dict", "tools"} & set(kwargs)
    if reserved:
        raise ValueError(f"chat_template_kwargs: {sorted(reserved)[0]!r} is set by the request "
                         "itself and cannot be passed here")

    def render(conv):
        try:
            return tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, chat_template=chat_template,
                tools=tools, **kwargs)
        except Exception as e:  # jinja2 errors raised by the template itself (bad roles, ...)
            raise ValueError(f"messages: the chat template rejected them: {e}") from e

    text = render(convo)
    specials = special_token_texts(tokenizer)
    for i, m in enumerate(convo):
        if any(s in m.get("name", "") or s in m["role"] or s in m.get("tool_call_id", "")
               for s in specials):
            raise ValueError(f"messages[{i}] must not have control-token text in its role, name "
                             "or tool_call_id")
    for name, value in kwargs.items():  # template variables (documents too) are user text
        if _has_special(value, specials):
            raise ValueError(f"chat_template_kwargs: {name!r} must not contain control-token text")
    if _has_special(tools, specials):
        raise ValueError("tools must not contain control-token text")
    for i, m in enumerate(convo):
        if _has_special(m.get("tool_calls"), specials):
            raise ValueError(f"messages[{i}].tool_calls must not contain control-token text")
    typed = [i for i, m in enumerate(convo) if any(s in m["content"] for s in specials)]
    if not typed:
        return text, _encode(tokenizer, text)
    return text, _encode_with_typed_text(tokenizer, convo, typed, render, text)


def _has_special(value, specials) -> bool:
    if isinstance(value, str):
        return any(s in value for s in specials)
    if isinstance(value, dict):
        return any(_has_special(k, specials) or _has_special(v, specials) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_has_special(v, specials) for v in value)
    return False


def _encode(tokenizer, text: str, **kw) -> list[int]:
    """ids of text; ValueError for text the tokenizer cannot take (a lone surrogate)."""
    try:
        return tokenizer.encode(text, add_special_tokens=False, **kw)
    except (TypeError, ValueError, UnicodeError) as e:
        raise ValueError(f"messages: the text cannot be encoded ({type(e).__name__}: {e})"[:300]) from e


def _encode_with_typed_text(tokenizer, convo, typed, render, text) -> list[int]:
    """Render with placeholders for the messages in `typed`, encode the template's pieces
    with special tokens parsed and those messages' text without; the pieces must rebuild
    `text` exactly, else the template transforms the content and the request is refused."""
    # Placeholders carry a fresh random nonce: typed text can never forge or collide with one.
    nonce = secrets.token_hex(8)
    marked = [dict(m, content=f"\ue000{nonce}-{i}\ue001") if i in typed else m
              for i, m in enumerate(convo)]
    pieces = re.split(f"\ue000{nonce}-(\\d+)\ue001", render(marked))
    ids, rebuilt = [], []
    for j, piece in enumerate(pieces):
        if j % 2:  # a placeholder: the message's own text, never control tokens
            content = convo[int(piece)]["content"]
            rebuilt.append(content)
            ids += _encode(tokenizer, content, split_special_tokens=True)
        elif piece:
            rebuilt.append(piece)
            ids += _encode(tokenizer, piece)
    if "".join(rebuilt) != text:
        raise ValueError(f"messages[{typed[0]}].content contains control-token text and the chat "
                         "template changes message content, so it cannot be encoded safely")
    return ids
