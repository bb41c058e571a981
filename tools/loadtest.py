#!/usr/bin/env python3
"""Load test for an OpenAI-compatible server on this machine (dflash serve, llama-server).

CLIENTS concurrent clients each send streaming chat completions back to back until DURATION
seconds have passed or MAX_REQUESTS requests were started; every request is bounded by
--timeout. Only loopback addresses are accepted. Prints one JSON object: requests, errors,
output tokens, throughput, time to first token and inter-token latency percentiles, and the
server's resident memory over the run (with --pid).

  python3 tools/loadtest.py --url http://127.0.0.1:8080 --clients 64 --duration 120 --pid PID

TTFT: from sending the request to the first chunk with content. ITL: per request, the time
from its first to its last content chunk divided by the tokens after the first (a round of
speculative decoding delivers several tokens in one chunk; this spreads its time over them).
Tokens are counted from the usage chunk (stream_options.include_usage), else one per chunk.
"""

import argparse
import asyncio
import ipaddress
import json
import os
import socket
import sys
import time
from urllib.parse import urlparse

import httpx

PROMPTS = [
    "Explain how a refrigerator works.",
    "Write a Python function that checks whether a number is prime.",
    "What are three tips for staying productive while working from home?",
    "Describe the water cycle in simple terms.",
    "Write a short poem about the ocean.",
    "What is the difference between a list and a tuple in Python?",
    "Give me a two-day itinerary for a trip to Rome.",
    "Why do leaves change color in the fall?",
]


def loopback_only(url):
    host = urlparse(url).hostname or ""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except socket.gaierror as e:
        sys.exit(f"cannot resolve {host}: {e}")
    for a in addrs:
        if not ipaddress.ip_address(a.split("%")[0]).is_loopback:
            sys.exit(f"refusing {url}: {a} is not a loopback address")


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def pct(values, p):
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


async def one_request(client, args, i, stats):
    body = {
        "model": args.model,
        "messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if args.temperature > 0:
        body["seed"] = i
    t0 = time.perf_counter()
    first = last = None
    chunks = 0
    usage = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                raise RuntimeError(f"stream error: {msg['error']}")
            if msg.get("usage"):
                usage = msg["usage"]
            for c in msg.get("choices") or []:
                if (c.get("delta") or {}).get("content"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    chunks += 1
    if first is None:
        raise RuntimeError("no content")
    tokens = usage["completion_tokens"] if usage else chunks
    stats["ttft"].append(first - t0)
    if tokens > 1:
        stats["itl"].append((last - first) / (tokens - 1))
    stats["tokens"] += tokens
    stats["requests"] += 1


async def client_loop(client, args, counter, deadline, stats):
    while time.perf_counter() < deadline and counter[0] < args.max_requests:
        i = counter[0]
        counter[0] += 1
        try:
            await asyncio.wait_for(one_request(client, args, i, stats), args.timeout)
        except Exception as e:  # noqa: BLE001 - every failure is counted and shown
            stats["errors"] += 1
            if len(stats["error_samples"]) < 5:
                stats["error_samples"].append(repr(e)[:300])


async def sample_memory(pid, deadline, out):
    while time.perf_counter() < deadline:
        m = rss_mib(pid)
        if m is not None:
            out.append(m)
        await asyncio.sleep(1)


async def main(args):
    loopback_only(args.url)
    stats = {"requests": 0, "errors": 0, "tokens": 0, "ttft": [], "itl": [],
             "error_samples": []}
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(base_url=args.url, limits=limits, timeout=timeout) as client:
        if args.model is None:
            args.model = (await client.get("/v1/models")).json()["data"][0]["id"]
        t0 = time.perf_counter()
        deadline = t0 + args.duration
        counter = [0]
        mem = []
        tasks = [client_loop(client, args, counter, deadline, stats) for _ in range(args.clients)]
        if args.pid:
            tasks.append(sample_memory(args.pid, deadline, mem))
        await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ms = lambda x: None if x is None else round(x * 1000, 2)  # noqa: E731
    report = {
        "url": args.url,
        "clients": args.clients,
        "duration_s": round(wall, 2),
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "requests": stats["requests"],
        "errors": stats["errors"],
        "error_samples": stats["error_samples"],
        "output_tokens": stats["tokens"],
        "throughput_tok_per_s": round(stats["tokens"] / wall, 2),
        "requests_per_s": round(stats["requests"] / wall, 3),
        "ttft_ms": {f"p{p}": ms(pct(stats["ttft"], p)) for p in (50, 90, 99)},
        "itl_ms": {f"p{p}": ms(pct(stats["itl"], p)) for p in (50, 90, 99)},
    }
    if mem:
        report["rss_mib"] = {"first": round(mem[0], 1), "max": round(max(mem), 1),
                             "last": round(mem[-1], 1)}
    print(json.dumps(report, indent=2))
    return 0 if stats["errors"] == 0 and stats["requests"] > 0 else 1


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8080")
    p.add_argument("--model", default=None, help="model name to send (default: the first listed)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=120, help="seconds (at most 3600)")
    p.add_argument("--max-requests", type=int, default=100000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--timeout", type=float, default=300, help="seconds per request")
    p.add_argument("--pid", type=int, default=None, help="server process to sample RSS of")
    a = p.parse_args()
    if not (0 < a.duration <= 3600 and 0 < a.clients <= 1024 and a.max_requests > 0):
        sys.exit("bounds: 0 < duration <= 3600, 0 < clients <= 1024, max_requests > 0")
    sys.exit(asyncio.run(main(a)))
