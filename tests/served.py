"""A `python -m moejax serve` subprocess on 127.0.0.1 for the HTTP tests, and its requests."""

from __future__ import annotations

import http.client
import json
import socket
import subprocess
import sys
import time

KEY = "sekret"
MAX_LEN = 96


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, model_dir, *flags, api_key: str | None = KEY):
        self.port, self.api_key = free_port(), api_key
        cmd = [
            sys.executable,
            "-m",
            "moejax",
            "serve",
            "--hf",
            str(model_dir),
            "--port",
            str(self.port),
            "--prefill-chunk",
            "8",
            "--max-seq-len",
            str(MAX_LEN),
            *flags,
        ]
        if api_key:
            cmd += ["--api-key", api_key]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.wait_healthy(300)

    def wait_healthy(self, seconds: float) -> None:
        """Until /health answers 200; a server that exits or stays down raises with its output."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited: {self.proc.stdout.read()[-3000:]}")
            try:
                if self.request("GET", "/health")[0] == 200:
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError("server did not come up")

    def request(self, method: str, path: str, body=None, key: str | None = "default", timeout: float = 120):
        """-> (status, raw body bytes)."""
        key = self.api_key if key == "default" else key
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            data = body if isinstance(body, (str, bytes)) or body is None else json.dumps(body)
            conn.request(method, path, body=data, headers={**headers, "Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def complete(self, body: dict, chat: bool = False) -> dict:
        status, raw = self.request("POST", "/v1/chat/completions" if chat else "/v1/completions", body)
        assert status == 200, raw
        return json.loads(raw)

    def metric(self, name: str) -> float:
        text = self.request("GET", "/metrics")[1].decode()
        return sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith(name + " ") or line.startswith(name + "{")
        )

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=120)
