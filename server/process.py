"""Child processes on 127.0.0.1: start one, wait until its /health answers, stop it.

Used by the vLLM adapter (the vLLM OpenAI server), the demo, the benchmark and the tests (the sidecar).
"""
from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the parent dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ChildServer:
    """`cmd` started in its own process group, output to `log`; `url` is ready once /health is 200."""

    def __init__(self, cmd: list[str], *, url: str, log: str | Path, env: dict[str, str] | None = None,
                 env_defaults: dict[str, str] | None = None, timeout_s: float = 600.0, check_pid: bool = False):
        """env: set for the child; env_defaults: set unless the parent environment has them;
        check_pid: /health answers {"pid": ...} and it must be the child's (not another server's)."""
        self.cmd, self.url, self.log, self.timeout_s, self.check_pid = cmd, url, Path(log), timeout_s, check_pid
        self.env = {**(env_defaults or {}), **os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self) -> "ChildServer":
        self.spawn()
        return self.wait_ready()

    def spawn(self) -> None:
        """Start the child; it gets SIGTERM if this thread's process dies (Linux PR_SET_PDEATHSIG), so a
        killed parent leaves no orphan engine. Call from a long-lived thread (the signal follows it)."""
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True, preexec_fn=_die_with_parent)

    def wait_ready(self) -> "ChildServer":
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[:4]} exited with {self.proc.returncode} before it was ready; "
                                   f"last log lines:\n{self.tail()}")
            try:
                r = httpx.get(f"{self.url}/health", timeout=2.0)
                if r.status_code == 200 and (not self.check_pid or r.json().get("pid") == self.proc.pid):
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(f"{self.url} not healthy after {self.timeout_s:.0f} s; last log lines:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:]) if self.log.exists() else ""

    def stop(self, *, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> None:
        """Signal the process group (the server and its workers) and wait; SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, sig)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def sidecar(model: str | Path, *, engine: str, port: int | None = None, log: str | Path,
            env: dict[str, str] | None = None, extra: list[str] = (), timeout_s: float = 900.0) -> ChildServer:
    """A `nvfp4-sampler serve MODEL --engine ENGINE` child on 127.0.0.1 (not started)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "nvfp4_sampler.server.cli", "serve", str(model), "--engine", engine, "--port", str(port), *extra]
    return ChildServer(cmd, url=f"http://127.0.0.1:{port}", log=log, env=env, timeout_s=timeout_s, check_pid=True)


def remote_sidecar(engine_url: str, *, port: int | None = None, log: str | Path, extra: list[str] = (),
                   env: dict[str, str] | None = None, timeout_s: float = 120.0) -> ChildServer:
    """A `nvfp4-sampler sidecar --engine-url URL` child on 127.0.0.1 (not started)."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "nvfp4_sampler.server.cli", "sidecar", "--engine-url", engine_url, "--port", str(port), *extra]
    return ChildServer(cmd, url=f"http://127.0.0.1:{port}", log=log, env=env, timeout_s=timeout_s, check_pid=True)
