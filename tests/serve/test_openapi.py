"""/openapi.json tells the truth: for good and bad requests on every route, the status code the
server sends is one the schema lists for that operation, with the content type listed for it
(an empty body where it lists none). 503 is checked on an app whose engine is not ready."""

import re

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.serve.conftest import API_KEY, MODEL

AUTH = {"Authorization": f"Bearer {API_KEY}"}
OK = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
RESP = {"model": MODEL, "input": "Hi", "max_output_tokens": 2}
CASES = [  # method, path, json body (or raw bytes), headers, the status we expect
    ("get", "/health", None, {}, 200), ("get", "/version", None, {}, 200),
    ("get", "/metrics", None, {}, 200), ("get", "/v1/models", None, AUTH, 200),
    ("get", "/v1/models", None, {}, 401),
    ("post", "/v1/completions", OK, AUTH, 200), ("post", "/v1/completions", {**OK, "stream": True}, AUTH, 200),
    ("post", "/v1/completions", {**OK, "max_tokens": 0}, AUTH, 400),
    ("post", "/v1/completions", {**OK, "top_k": "many"}, AUTH, 400),
    ("post", "/v1/completions", b"{not json", AUTH, 400),
    ("post", "/v1/completions", {**OK, "model": "other"}, AUTH, 404),
    ("post", "/v1/completions", OK, {}, 401),
    ("post", "/v1/chat/completions", CHAT, AUTH, 200),
    ("post", "/v1/chat/completions", {**CHAT, "stream": True}, AUTH, 200),
    ("post", "/v1/chat/completions", {**CHAT, "messages": []}, AUTH, 400),
    ("post", "/v1/chat/completions", {**CHAT, "model": "other"}, AUTH, 404),
    ("post", "/tokenize", {"model": MODEL, "prompt": "Hi"}, {}, 200),
    ("post", "/tokenize", {"model": MODEL, "prompt": "Hi", "messages": CHAT["messages"]}, {}, 400),
    ("post", "/tokenize", {"model": "other", "prompt": "Hi"}, {}, 404),
    ("post", "/detokenize", {"model": MODEL, "tokens": [1, 2]}, {}, 200),
    ("post", "/detokenize", {"model": MODEL, "tokens": [10**9]}, {}, 400),
    ("get", "/kv_cache/blocks", None, {}, 200), ("get", "/dashboard", None, {}, 200),
    ("get", "/tokenizer_info", None, {}, 200),
    ("post", "/v1/responses", RESP, AUTH, 200), ("post", "/v1/responses", {**RESP, "stream": True}, AUTH, 200),
    ("post", "/v1/responses", {**RESP, "input": []}, AUTH, 400),
    ("post", "/v1/responses", {**RESP, "model": "other"}, AUTH, 404),
    ("post", "/v1/responses", RESP, {}, 401),
    ("get", "/v1/responses/resp_nope", None, AUTH, 404), ("get", "/v1/responses/resp_nope", None, {}, 401),
]


def operation_path(schema, path: str) -> str:
    """The schema's path of a request path ("/v1/responses/x" -> "/v1/responses/{response_id}")."""
    if path in schema["paths"]:
        return path
    for p in schema["paths"]:
        if re.fullmatch(re.sub(r"\\{[^}]+\\}", "[^/]+", re.escape(p)), path):
            return p
    raise KeyError(path)


def check(schema, method, path, r):
    documented = schema["paths"][operation_path(schema, path)][method]["responses"]
    assert str(r.status_code) in documented, (method, path, r.status_code, r.text[:200])
    content = documented[str(r.status_code)].get("content", {})
    media = r.headers.get("content-type", "").split(";")[0].strip()
    if not content:
        assert r.content == b"" and not media, (method, path)
    else:
        assert media in content, (method, path, r.status_code, media, list(content))


def test_every_response_is_documented(server):
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    seen = set()
    for method, path, body, headers, want in CASES:
        kw = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
        if isinstance(body, bytes):
            headers = {**headers, "content-type": "application/json"}
        r = httpx.request(method.upper(), server.url + path, headers=headers, timeout=120, **kw)
        assert r.status_code == want, (method, path, r.status_code, r.text[:200])
        check(schema, method, path, r)
        seen.add((method, operation_path(schema, path)))
    assert seen == {(m, p) for p, ops in schema["paths"].items() for m in ops}  # every operation
    for ops in schema["paths"].values():
        for op in ops.values():
            assert "422" not in op["responses"] and "413" in op["responses"]
            for code, r in op["responses"].items():
                if not code.startswith("2"):
                    assert list(r["content"]) == ["application/json"], (code, r)



@pytest.mark.parametrize("method, path, body", [
    ("get", "/health", None), ("post", "/v1/completions", OK), ("post", "/tokenize", {"prompt": "x"}),
    ("get", "/kv_cache/blocks", None)])
def test_not_ready_is_a_documented_503(method, path, body):
    from serve.app import build_app
    from serve.context import ServerContext
    from serve.metrics import PrometheusStatLogger

    app = build_app(ServerContext(MODEL), PrometheusStatLogger(lambda: None, MODEL))
    with TestClient(app) as c:
        r = c.request(method.upper(), path, json=body)
        assert r.status_code == 503
        check(app.openapi(), method, path, r)
