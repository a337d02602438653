"""Real `pdllm serve` processes on loopback for end-to-end tests (started, awaited, killed)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

# No end anchor: another thread's log line may follow on the same line of stderr.
_READY = re.compile(r"serving on ([^\s,]+)(?:, metrics on port (\d+))?")


@dataclass
class ServeProcess:
    role: str
    args: list[str]
    proc: subprocess.Popen | None = None
    address: str = ""
    metrics_port: int | None = None
    log: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # added to (or overriding) this process's environment

    def start(self, timeout_s: float = 90.0) -> ServeProcess:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("PDLLM_AUTH_TOKEN", None)
        env.update(self.env)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "pdllm.shared.app.serve",
                "--role",
                self.role,
                "--host",
                "127.0.0.1",
                *self.args,
            ],
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        ready = threading.Event()

        def pump() -> None:
            assert self.proc is not None and self.proc.stderr is not None
            for line in self.proc.stderr:
                self.log.append(line.rstrip())
                m = _READY.search(line.strip())
                if m and not ready.is_set():
                    self.address = m.group(1)
                    self.metrics_port = int(m.group(2)) if m.group(2) else None
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + timeout_s
        while not ready.wait(0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(f"{self.role} did not start:\n" + "\n".join(self.log[-30:]))
        return self

    def metric(self, name: str, labels: str = "") -> float:
        """Sum of a Prometheus sample (``name{labels}``) scraped from the process's /metrics."""
        assert self.metrics_port is not None
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).read().decode()
        )
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name) and (not labels or labels in line) and not line.startswith("#"):
                head, _, value = line.rpartition(" ")
                if head.split("{")[0] == name:
                    total += float(value)
        return total

    def terminate(self) -> int:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=60)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def worker_args(model: Path, kv_url: str, extra: list[str] | None = None) -> list[str]:
    return ["--model", str(model), "--port", "0", "--metrics-port", "0", "--kv-url", kv_url, *(extra or [])]
