"""A real `pagoda serve` in a subprocess on 127.0.0.1, for the server tests (no tests here)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

STARTUP_TIMEOUT_S = 120
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RemoteServer:
    """`python -m pagoda.entrypoints.cli serve [MODEL] --port N --dtype float32 ...`,
    started and waited for (GET /health == 200); its log is kept for failures."""

    def __init__(self, model: str | None, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.base_url = self.url + "/v1"
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve"]
        cmd += [model] if model is not None else []  # None: the default model
        cmd += ["--port", str(self.port), "--dtype", "float32"]
        cmd += ["--kv-cache-memory-bytes", str(16 << 20), "--disable-uvicorn-access-log", *args]
        fd, self.log_path = tempfile.mkstemp(prefix="pagoda-serve-", suffix=".log")
        self.log = os.fdopen(fd, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        log = self.output()
        self.stop()
        raise RuntimeError(f"server not ready in {STARTUP_TIMEOUT_S} s:\n{log}")

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        with open(self.log_path) as f:
            return f.read()

    def client(self, **kwargs):
        import openai

        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, **kwargs)

    def async_client(self, **kwargs):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url, api_key="none", max_retries=0, **kwargs)

    def post(self, path: str, **kwargs) -> httpx.Response:
        return httpx.post(self.url + path, timeout=60, **kwargs)

    def metrics(self) -> dict[tuple[str, tuple], float]:
        """(sample name, sorted label items without model_name) -> value, from /metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
                out[(s.name, labels)] = s.value
        return out

    def wait_idle(self, timeout: float = 30.0) -> dict[tuple[str, tuple], float]:
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (
                m[("pagoda:num_requests_running", ())] == 0
                and m[("pagoda:num_requests_waiting", ())] == 0
            ):
                return m
            if time.monotonic() > deadline:
                raise TimeoutError(f"server still busy: {m}")
            time.sleep(0.05)

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if not self.log.closed:
            self.log.close()
            os.unlink(self.log_path)

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
