"""Fixtures for the `dflash serve` tests: the server binary, a tiny model and drafter (made by
the Rust test that runs this suite), servers on ephemeral loopback ports, and `dflash generate`
as the reference."""

import json
import os
import re
import signal
import subprocess
import threading
import time

import httpx
import openai
import pytest

BIN = os.environ.get("DFLASH_BIN")
MODEL = os.environ.get("DFLASH_TEST_MODEL")
DRAFT = os.environ.get("DFLASH_TEST_DRAFT")

if not (BIN and MODEL and DRAFT):
    raise RuntimeError(
        "run these tests through `cargo test -p dflash-cli --test serve_openai`, which builds "
        "the binary and the tiny model (DFLASH_BIN, DFLASH_TEST_MODEL, DFLASH_TEST_DRAFT)"
    )


class Server:
    """A `dflash serve` process on 127.0.0.1 with an ephemeral port."""

    def __init__(self, *extra):
        args = [BIN, "serve", "--model", MODEL, "--draft", DRAFT, "--port", "0", *extra]
        env = dict(os.environ, DFLASH_LOG="warn")
        self.proc = subprocess.Popen(
            args, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env
        )
        self.log = []
        deadline = time.time() + 120
        self.url = None
        while time.time() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)
                break
        if self.url is None:
            self.proc.kill()
            raise RuntimeError("the server did not start:\n" + "".join(self.log))
        # Keep draining stderr so the server never blocks on a full pipe.
        self._drain = threading.Thread(target=self._read_rest, daemon=True)
        self._drain.start()
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def _read_rest(self):
        for line in self.proc.stderr:
            self.log.append(line)

    def metrics(self):
        """The /metrics samples as {name{labels}: value}."""
        text = self.http.get("/metrics").text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def stop(self, timeout=30):
        """SIGTERM; returns the exit code."""
        self.http.close()
        self.client.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


@pytest.fixture(scope="session")
def server():
    s = Server()
    yield s
    code = s.stop()
    assert code == 0, "".join(s.log)
    assert "panicked" not in "".join(s.log)


def generate(prompt, *extra):
    """`dflash generate` on the same model and drafter: the reference (greedy)."""
    args = [BIN, "generate", prompt, "--model", MODEL, "--draft", DRAFT,
            "--output-format", "json", *extra]
    out = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.fixture(scope="session")
def reference():
    """Greedy `generate` results, cached per argument list."""
    cache = {}

    def get(prompt, *extra):
        key = (prompt, *extra)
        if key not in cache:
            cache[key] = generate(prompt, *extra)
        return cache[key]

    return get
