"""Client mistakes get 4xx with an OpenAI error body and the server keeps serving; the API key
is enforced on /v1; /metrics exposes vLLM's series; a dropped stream frees its blocks."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.serve.conftest import MODEL

OK = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

CASES = [  # (route, body or raw bytes, status, param, words in the message)
    ("/v1/completions", b"{not json", 400, None, "not valid JSON"),
    ("/v1/completions", {"model": MODEL}, 400, "prompt", "Field required"),
    ("/v1/completions", {**OK, "max_tokens": "many"}, 400, "max_tokens", "valid integer"),
    ("/v1/completions", {**OK, "temperature": -0.5}, 400, "temperature", "greater than or equal to 0"),
    ("/v1/completions", {**OK, "top_p": 0}, 400, "top_p", "greater than 0"),
    ("/v1/completions", {**OK, "top_p": 1.01}, 400, "top_p", "less than or equal to 1"),
    ("/v1/completions", {**OK, "n": 0}, 400, "n", "greater than or equal to 1"),
    ("/v1/completions", {**OK, "n": 17}, 400, "n", "less than or equal to 16"),
    ("/v1/completions", {**OK, "max_tokens": 0}, 400, "max_tokens", "must be >= 1"),  # 0: echo only
    ("/v1/completions", {**OK, "max_tokens": 1100}, 400, "prompt", "(1100)"),
    ("/v1/completions", {**OK, "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {**OK, "prompt": []}, 400, "prompt", "empty"),
    ("/v1/completions", {**OK, "prompt": [1, 49152]}, 400, "prompt_token_ids", "vocabulary"),
    ("/v1/completions", {**OK, "model": "gpt-4o"}, 404, "model", "does not exist"),
    ("/v1/completions", {**OK, "min_tokens": 1, "stop_token_ids": [10**10]}, 400, "stop_token_ids", "vocabulary"),
    ("/v1/completions", {**OK, "logit_bias": {"50000": 5}}, 400, "logit_bias", "vocabulary"),
    ("/v1/completions", {**OK, "logit_bias": {"x": 5}}, 400, "logit_bias", "token ids"),
    ("/v1/chat/completions", {**CHAT, "allowed_token_ids": []}, 400, "allowed_token_ids", "non-empty"),
    ("/v1/chat/completions", {**CHAT, "bad_words": [""]}, 400, "bad_words", "non-empty"),
    ("/v1/completions", {**OK, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream"),
    ("/v1/completions", {**OK, "best_of": 3}, 400, "best_of", "must equal n"),
    ("/v1/chat/completions", {**CHAT, "messages": []}, 400, "messages", "empty"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user"}, 3]}, 400, "messages", "messages.1"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2000}, 400, "prompt", "1024"),
    ("/v1/chat/completions", {**CHAT, "model": "nope"}, 404, "model", "does not exist"),
]


@pytest.mark.parametrize("route,body,status,param,words", CASES)
def test_bad_request_gets_4xx_and_the_next_request_succeeds(server, route, body, status, param, words):
    if isinstance(body, bytes):
        r = httpx.post(server.url + route, content=body, timeout=60,
                       headers={**server.headers, "content-type": "application/json"})
    else:
        r = server.post(route, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param and words in err["message"], err
    ok = server.post("/v1/completions", OK)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] is not None


def test_prompt_too_long_message_states_both_numbers(server):
    r = server.post("/v1/completions", {**OK, "prompt": "word " * 1000, "max_tokens": 100})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "max_model_len" in msg and "1024" in msg and "(100)" in msg


def test_body_above_10_mib_gets_413(server):
    big = b'{"prompt": "' + b"a" * (10 * 1024 * 1024 + 10) + b'"}'
    r = httpx.post(server.url + "/v1/completions", content=big, timeout=60,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413

    def chunked():  # no Content-Length: the limit is counted while the body arrives
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)]

    r = httpx.post(server.url + "/v1/completions", content=chunked(), timeout=60,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    small = b'{"prompt": "Hi", "max_tokens": 2}'
    r = httpx.post(server.url + "/v1/completions", content=iter([small[:5], small[5:]]), timeout=60,
                   headers={**server.headers, "content-type": "application/json"})
    assert r.status_code == 200, r.text  # a small chunked body is replayed intact


def test_huge_top_k_is_clamped_not_fatal(server):
    r = server.post("/v1/completions", {**OK, "top_k": 10**12, "temperature": 0.7})
    assert r.status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "test-key"}])
def test_api_key_is_required_on_v1_routes(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/chat/completions")):
        r = httpx.request(method, server.url + path, json=OK, headers=headers, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert httpx.get(server.url + "/health", headers=headers).status_code == 200
    assert httpx.get(server.url + "/v1/models", headers=server.headers).status_code == 200


def test_metrics_expose_vllm_series(server):
    server.post("/v1/completions", {**OK, "max_tokens": 3, "ignore_eos": True})
    m = server.metrics()
    names = {k.partition("{")[0] for k in m}
    for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_free_blocks",
              "num_total_blocks", "prefix_cache_queries_total", "prefix_cache_hits_total",
              "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
              "request_success_total", "time_to_first_token_seconds_bucket",
              "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
              "request_queue_time_seconds_bucket", "request_prompt_tokens_bucket",
              "request_generation_tokens_bucket", "request_time_per_output_token_seconds_bucket"):
        assert f"jaxkv:{n}" in names, n
    assert not any(n.endswith("_created") for n in names)
    assert server.metric("jaxkv:num_total_blocks") == (128 << 20) // (16 * 46080) - 1
    assert server.metric("jaxkv:num_compiled_token_buckets") == server.metric("jaxkv:num_token_buckets") == 3
    assert 0.0 <= server.metric("jaxkv:kv_cache_usage_perc") <= 1.0
    ttft_edges = {k.split('le="')[1].split('"')[0] for k in m if k.startswith("jaxkv:time_to_first_token_seconds_bucket")}
    assert {"0.001", "2560.0", "+Inf"} <= ttft_edges
    before = server.metric("jaxkv:request_success_total", finished_reason="length")
    gen_before = server.metric("jaxkv:generation_tokens_total")
    itl_before = server.metric("jaxkv:inter_token_latency_seconds_count")
    server.post("/v1/completions", {**OK, "max_tokens": 4, "ignore_eos": True})
    assert server.metric("jaxkv:request_success_total", finished_reason="length") == before + 1
    assert server.metric("jaxkv:generation_tokens_total") == gen_before + 4
    assert server.metric("jaxkv:inter_token_latency_seconds_count") == itl_before + 3


def _wait_all_free(server, timeout=10.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if (server.metric("jaxkv:num_free_blocks") == server.metric("jaxkv:num_total_blocks")
                and server.metric("jaxkv:num_requests_running") == 0):
            return True
        time.sleep(0.05)
    return False


def test_dropped_stream_frees_all_its_blocks(server):
    body = {**OK, "prompt": "Tell me a very long story. " * 30, "max_tokens": 600, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=server.headers,
                      timeout=60) as r:
        n, held = 0, 0
        for line in r.iter_lines():
            n += line.startswith("data: ")
            if n == 3:  # (leaving the loop closes the connection, so measure first)
                held = server.metric("jaxkv:num_total_blocks") - server.metric("jaxkv:num_free_blocks")
                break
    assert held > 0  # the request was holding blocks when the client left
    assert _wait_all_free(server)


def test_non_streaming_client_that_gives_up_frees_its_blocks(server):
    body = {**OK, "prompt": "Tell me a very long story. " * 30, "max_tokens": 600, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, headers=server.headers, timeout=2.0)
    assert _wait_all_free(server)
    assert server.post("/v1/completions", OK).status_code == 200
