"""Malformed requests get a 4xx with an OpenAI-style error body and the server keeps
serving; a disconnected client's row is freed; the queue bound answers 429 with
Retry-After; SIGTERM drains and exits 0."""

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from conftest import Server

GOOD = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "temperature": 0}


def with_(**kw):
    body = dict(GOOD)
    body.update(kw)
    return json.dumps(body).encode()


def bad_cases(model):
    long_stop = ["x"] * 100
    return [
        ("bad JSON", "/v1/chat/completions", b"{not json", 400),
        ("empty body", "/v1/chat/completions", b"", 400),
        ("invalid UTF-8", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}', 400),
        ("lone surrogate", "/v1/chat/completions",
         b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400),
        ("messages not a list", "/v1/chat/completions", with_(messages="hi"), 400),
        ("empty messages", "/v1/chat/completions", with_(messages=[]), 400),
        ("message without content", "/v1/chat/completions",
         with_(messages=[{"role": "user"}]), 400),
        ("unknown role", "/v1/chat/completions",
         with_(messages=[{"role": "tool", "content": "x"}]), 400),
        ("image part", "/v1/chat/completions",
         with_(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400),
        ("temperature a string", "/v1/chat/completions", with_(temperature="hot"), 400),
        ("negative temperature", "/v1/chat/completions", with_(temperature=-1), 400),
        ("absurd temperature", "/v1/chat/completions", with_(temperature=1e30), 400),
        ("top_p 0", "/v1/chat/completions", with_(top_p=0), 400),
        ("top_k -5", "/v1/chat/completions", with_(top_k=-5), 400),
        ("min_p 2", "/v1/chat/completions", with_(min_p=2), 400),
        ("frequency_penalty 3", "/v1/chat/completions", with_(frequency_penalty=3), 400),
        ("negative max_tokens", "/v1/chat/completions", with_(max_tokens=-1), 400),
        ("max_tokens 0", "/v1/chat/completions", with_(max_tokens=0), 400),
        ("absurd max_tokens", "/v1/chat/completions", with_(max_tokens=10**12), 400),
        ("max_tokens a float", "/v1/chat/completions", with_(max_tokens=2.5), 400),
        ("n 2", "/v1/chat/completions", with_(n=2), 400),
        ("seed a string", "/v1/chat/completions", with_(seed="x"), 400),
        ("100 stop strings", "/v1/chat/completions", with_(stop=long_stop), 400),
        ("stop a number", "/v1/chat/completions", with_(stop=5), 400),
        ("top_logprobs 50", "/v1/chat/completions", with_(logprobs=True, top_logprobs=50), 400),
        ("stream_options without stream", "/v1/chat/completions",
         with_(stream_options={"include_usage": True}), 400),
        ("unknown model", "/v1/chat/completions", with_(model="gpt-4"), 404),
        ("prompt too long for the context", "/v1/completions",
         json.dumps({"prompt": "x" * 5000, "max_tokens": 2}).encode(), 400),
        ("prompt + max_tokens beyond the context", "/v1/completions",
         json.dumps({"prompt": "hello", "max_tokens": 4096}).encode(), 400),
        ("empty prompt", "/v1/completions", json.dumps({"prompt": ""}).encode(), 400),
        ("two prompts", "/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400),
        ("token id outside the vocabulary", "/v1/completions",
         json.dumps({"prompt": [1, 2, 999999]}).encode(), 400),
        ("echo", "/v1/completions", json.dumps({"prompt": "a", "echo": True}).encode(), 400),
        ("body over the limit", "/v1/chat/completions",
         with_(messages=[{"role": "user", "content": "x" * ((1 << 20) + 4096)}]), 413),
    ]


def test_every_malformed_request_gets_a_4xx_and_the_server_keeps_serving(server):
    model = server.client.models.list().data[0].id
    for name, path, body, status in bad_cases(model):
        r = server.http.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == status, (name, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"], name
        ok = server.http.post("/v1/chat/completions", content=with_())
        assert ok.status_code == 200, (name, ok.text)
    r = server.http.get("/no/such/path")
    assert r.status_code == 404 and r.json()["error"]["message"]
    r = server.http.get("/v1/chat/completions")
    assert r.status_code == 405
    # The openai client maps them to its exceptions.
    with pytest.raises(openai.BadRequestError):
        server.client.chat.completions.create(model=model, messages=[], max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(
            model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    m = server.metrics()
    assert m['dflash_requests_total{endpoint="chat_completions",status="400"}'] >= 20
    assert "panicked" not in "".join(server.log)


def wait_for(cond, timeout=20):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def test_a_disconnected_client_frees_its_row(server):
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.url, timeout=30) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(3)]
            assert any(x.startswith("data: ") for x in got)
            assert server.metrics()["dflash_running_rows"] == 1
        # Leaving the block closed the connection mid-stream.
    assert wait_for(lambda: server.metrics()["dflash_running_rows"] == 0), server.metrics()
    assert server.metrics()['dflash_requests_cancelled_total{reason="disconnect"}'] >= 1
    assert server.http.post("/v1/chat/completions", content=with_()).status_code == 200


def long_stream(url, started, results):
    body = {"messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
            "temperature": 0, "stream": True}
    try:
        with httpx.Client(base_url=url, timeout=60) as c:
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                results.append(r.status_code)
                for line in r.iter_lines():
                    started.set()
                    if line == "data: [DONE]":
                        results.append("done")
    except httpx.HTTPError as e:
        results.append(repr(e))


def test_queue_bound_answers_429_with_retry_after():
    s = Server("--max-batch", "1", "--max-queue", "1")
    try:
        started, results = threading.Event(), []
        first = threading.Thread(target=long_stream, args=(s.url, started, results))
        first.start()
        assert started.wait(30)
        assert wait_for(lambda: s.metrics()["dflash_running_rows"] == 1)
        # The second waits in the queue (its own connection), the third finds it full.
        second = threading.Thread(target=long_stream, args=(s.url, threading.Event(), []))
        second.start()
        assert wait_for(lambda: s.metrics()["dflash_queued_requests"] == 1)
        r = s.http.post("/v1/chat/completions", content=with_())
        assert r.status_code == 429, r.text
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["type"] == "rate_limit_error"
    finally:
        code = s.stop()
    first.join(30)
    second.join(30)
    assert code == 0, "".join(s.log)


def test_sigterm_drains_running_rows_and_exits_0():
    s = Server("--shutdown-grace", "1")
    started, results = threading.Event(), []
    t = threading.Thread(target=long_stream, args=(s.url, started, results))
    t.start()
    assert started.wait(30)
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    code = s.proc.wait(timeout=20)
    assert code == 0, "".join(s.log)
    assert time.time() - t0 < 10
    t.join(30)
    # The stream ended cleanly (finished, or cancelled with an error event, then [DONE]).
    assert results and results[0] == 200, results
    s.stop()


def test_short_load_test_has_no_errors(server):
    """The CI run of tools/loadtest.py: 8 streaming clients for a few seconds."""
    import os
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(__file__), "..", "..", "..", "..", "tools", "loadtest.py")
    out = subprocess.run(
        [sys.executable, script, "--url", server.url, "--clients", "8", "--duration", "4",
         "--max-tokens", "16", "--pid", str(server.proc.pid)],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    report = json.loads(out.stdout)
    assert report["errors"] == 0 and report["requests"] >= 8, report
    assert report["ttft_ms"]["p50"] is not None
