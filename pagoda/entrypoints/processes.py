"""Engine servers as child processes (`pagoda serve --data-parallel-size`'s replicas,
the many-model server's models): ports, pinning, health and stopping; torch-free."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time

import httpx


def stop_processes(procs: list[subprocess.Popen], grace_s: float) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def pin_child(cores: list[int] | None) -> None:
    """In the child's process before it runs: its cores, and SIGTERM when its parent
    dies."""
    import ctypes

    if cores is not None:
        os.sched_setaffinity(0, cores)
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def healthy(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=1.0).status_code == 200
    except httpx.HTTPError:
        return False


def wait_healthy(url: str, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    """Until the server `proc` runs answers on `url`/health; RuntimeError if it exits
    first or takes longer than `timeout_s` (then it is killed)."""
    deadline = time.monotonic() + timeout_s
    while not healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{proc.args} not ready in {timeout_s:.0f} s")
        time.sleep(0.5)


def without_options(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the options `names` (as `--name value` or `--name=value`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in names:
            skip = True
        elif not any(arg.startswith(name + "=") for name in names):
            out.append(arg)
    return out
