"""`dflash serve` through the official `openai` client: chat and completions, streamed and
not, equal `dflash generate` token for token (greedy), stop strings, max_tokens, usage,
log-probabilities, and continuous batching of greedy and sampled requests."""

from concurrent.futures import ThreadPoolExecutor

PROMPT = "Tell me a story about a robot."
N = 40


def chat(server, prompt=PROMPT, **kw):
    kw.setdefault("max_tokens", N)
    kw.setdefault("temperature", 0)
    extra = kw.pop("extra_body", {})
    extra.setdefault("return_token_ids", True)
    return server.client.chat.completions.create(
        model=server.client.models.list().data[0].id,
        messages=[{"role": "user", "content": prompt}],
        extra_body=extra,
        **kw,
    )


def test_models_health_metrics(server):
    models = server.client.models.list().data
    assert len(models) == 1 and models[0].object == "model"
    health = server.http.get("/health").json()
    assert health["status"] == "ok"
    assert set(health["kv_cache"]) == {"bytes", "rows", "positions", "reserved_positions"}
    m = server.metrics()
    assert "dflash_running_rows" in m and "dflash_queued_requests" in m
    assert "dflash_kv_cache_bytes" in m and "dflash_kv_cache_positions" in m
    assert m["dflash_batch_capacity_rows"] == 16


def test_chat_greedy_equals_generate(server, reference):
    ref = reference(PROMPT, "-n", str(N))
    r = chat(server)
    choice = r.choices[0]
    assert choice.message.content == ref["text"]
    assert choice.model_extra["token_ids"] == ref["tokens"]
    assert choice.finish_reason == ("length" if ref["finish_reason"] == "length" else "stop")
    assert r.usage.prompt_tokens == ref["stats"]["prompt_tokens"]
    assert r.usage.completion_tokens == ref["stats"]["generated_tokens"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    spec = r.model_extra["dflash"]
    assert spec["rounds"] + spec["plain_steps"] >= 1


def test_chat_stream_equals_generate_with_usage(server, reference):
    ref = reference(PROMPT, "-n", str(N))
    stream = chat(server, stream=True, stream_options={"include_usage": True})
    text, ids, finish, usage, roles = "", [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            assert chunk.choices == []
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        assert chunk.object == "chat.completion.chunk"
        if c.delta.role:
            roles.append(c.delta.role)
        text += c.delta.content or ""
        ids += (c.model_extra or {}).get("token_ids") or []
        if c.finish_reason:
            finish = c.finish_reason
    assert roles == ["assistant"]
    assert text == ref["text"]
    assert ids == ref["tokens"]
    assert finish in ("stop", "length")
    assert usage.completion_tokens == ref["stats"]["generated_tokens"]
    assert usage.prompt_tokens == ref["stats"]["prompt_tokens"]


def test_completions_raw_prompt_equals_generate_raw(server, reference):
    ref = reference(PROMPT, "--raw", "-n", "24")
    model = server.client.models.list().data[0].id
    r = server.client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert r.object == "text_completion"
    assert r.choices[0].text == ref["text"]
    assert r.choices[0].model_extra["token_ids"] == ref["tokens"]
    assert r.usage.completion_tokens == ref["stats"]["generated_tokens"]
    assert r.usage.prompt_tokens == ref["stats"]["prompt_tokens"]
    streamed = "".join(
        c.choices[0].text if c.choices else ""
        for c in server.client.completions.create(
            model=model, prompt=PROMPT, max_tokens=24, temperature=0, stream=True
        )
    )
    assert streamed == ref["text"]


def test_stop_strings_and_max_tokens(server, reference):
    ref = reference(PROMPT, "-n", str(N))
    text = ref["text"]
    assert len(text) >= 12, f"the reference is too short to cut: {text!r}"
    stop = text[6:9]
    want = text[: text.index(stop)]
    for stream in (False, True):
        r = chat(server, stop=[stop, "\u0000never"], stream=stream)
        if stream:
            got, finish = "", None
            for chunk in r:
                if chunk.choices:
                    got += chunk.choices[0].delta.content or ""
                    finish = chunk.choices[0].finish_reason or finish
        else:
            got, finish = r.choices[0].message.content, r.choices[0].finish_reason
        assert got == want, (stream, got, want)
        assert finish == "stop"
    # A single string works too.
    assert chat(server, stop=stop).choices[0].message.content == want

    r = chat(server, max_tokens=3)
    assert r.usage.completion_tokens == 3
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].model_extra["token_ids"] == ref["tokens"][:3]
    r = chat(server, max_completion_tokens=5)
    assert r.usage.completion_tokens == 5


def test_logprobs(server):
    r = chat(server, logprobs=True, top_logprobs=3, max_tokens=8)
    content = r.choices[0].logprobs.content
    ids = r.choices[0].model_extra["token_ids"]
    assert len(content) == len(ids) >= 1
    for t in content:
        assert t.logprob <= 0
        assert len(t.top_logprobs) == 3
        tops = [x.logprob for x in t.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert t.top_logprobs[0].token == t.token
        assert abs(t.top_logprobs[0].logprob - t.logprob) < 1e-5
    model = server.client.models.list().data[0].id
    c = server.client.completions.create(
        model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == c.choices[0].text


def test_greedy_and_sampled_rows_share_a_batch(server, reference):
    """Requests join and leave the running batch; greedy rows still equal `generate`,
    sampled rows depend only on their seed."""
    prompts = [PROMPT, "Hi", "What is two plus two?", PROMPT]
    refs = [reference(p, "-n", str(N)) for p in prompts]

    def greedy(p):
        return chat(server, prompt=p)

    def sampled(seed):
        return chat(server, temperature=1.0, top_p=0.9, seed=seed, max_tokens=30)

    with ThreadPoolExecutor(8) as pool:
        g = [pool.submit(greedy, p) for p in prompts]
        s = [pool.submit(sampled, seed) for seed in (7, 7, 8, 9)]
        greedy_out = [f.result() for f in g]
        sampled_out = [f.result() for f in s]
    for r, ref in zip(greedy_out, refs):
        assert r.choices[0].model_extra["token_ids"] == ref["tokens"]
    a, b = (x.choices[0].model_extra["token_ids"] for x in sampled_out[:2])
    assert a == b
    # And alone, the same seed gives the same tokens.
    assert sampled(7).choices[0].model_extra["token_ids"] == a
    m = server.metrics()
    assert m["dflash_rounds_total"] >= 1
    assert m["dflash_generation_tokens_total"] >= 1
    assert m["dflash_time_to_first_token_seconds_count"] >= 8
