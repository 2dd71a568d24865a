"""A Flower deployment on this machine for tests and benchmarks (not shipped in the package):
a SuperLink and SuperNodes as real processes on free 127.0.0.1 ports.

Every process is started in its own process group and ended with it (a SuperNode's
``flower-superexec`` children outlive the SuperNode otherwise). Connection settings go to a
private ``FLWR_HOME``; the SuperLink runs apps in this Python environment
(``--disable-runtime-dependency-installation``) instead of installing their dependencies.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

CONNECTION = "nefl-local"  # the connection name in FLWR_HOME/config.toml


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` still has a running process (zombies, ended processes
    that no parent has reaped yet, do not count)."""
    proc = Path("/proc")
    if not proc.is_dir():
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def run_config_arg(values: dict) -> str:
    """``flwr run --run-config`` syntax for ``values`` (TOML values, space-separated)."""
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items())


class LocalDeployment:
    """A SuperLink and SuperNodes on this machine; use it as a context manager.

    Args:
        folder: working directory of the processes; their logs go to ``folder/NAME.log``.
        bin_dir: where ``flower-superlink``, ``flower-supernode`` and ``flwr`` are (default:
            next to this Python).
    """

    def __init__(self, folder: str | Path, bin_dir: str | Path | None = None):
        self.folder = Path(folder)
        self.bin = Path(bin_dir) if bin_dir else Path(sys.executable).parent
        self.home = self.folder / "flwr-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "FLWR_HOME": str(self.home),
                    "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}"}  # SuperNodes start flower-superexec
        self.env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
        self.processes: dict[str, subprocess.Popen] = {}
        self.port = free_port()
        (self.home / "config.toml").write_text(
            f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
            f'address = "127.0.0.1:{self.port}"\ninsecure = true\n')

    def __enter__(self) -> "LocalDeployment":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, name: str, *command: str) -> subprocess.Popen:
        """Start ``command`` (a program in ``bin_dir`` and its arguments) as process group ``name``."""
        with open(self.folder / f"{name}.log", "w") as log:
            process = subprocess.Popen([str(self.bin / command[0]), *command[1:]], cwd=self.folder, env=self.env,
                                       stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.processes[name] = process
        return process

    def start_superlink(self, timeout: float = 60.0) -> None:
        """Start the SuperLink (insecure, on ``self.port``) and wait until it accepts connections."""
        self.start("superlink", "flower-superlink", "--insecure", "--port", str(self.port),
                   "--disable-runtime-dependency-installation")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return
            if self.processes["superlink"].poll() is not None:
                break
            time.sleep(0.2)
        raise RuntimeError(f"the SuperLink did not open port {self.port}: {self.log('superlink')}")

    def start_supernode(self, partition: int, num_partitions: int, isolation: str = "subprocess", **node_config) -> str:
        """Start SuperNode ``supernodeP`` for ``partition``; ``node_config`` adds keys such as
        ``max_tier="g0.5"`` or ``threads=1`` (underscores become dashes). ``isolation``:
        ``subprocess`` (Flower starts a ClientApp process per message) or ``process`` (one
        long-running ``nefl-zoo clientapp`` beside the SuperNode: process group
        ``supernodeP-clientapp``, ended with the SuperNode by :meth:`end`). Returns its name."""
        values = {"partition-id": partition, "num-partitions": num_partitions,
                  **{k.replace("_", "-"): v for k, v in node_config.items()}}
        name, runtime = f"supernode{partition}", free_port()
        self.start(name, "flower-supernode", "--insecure", "--superlink", f"127.0.0.1:{self.port}",
                   "--port", str(runtime), "--node-config", run_config_arg(values), "--isolation", isolation)
        if isolation == "process":
            self.start(f"{name}-clientapp", "nefl-zoo", "clientapp", "--insecure",
                       "--runtime-api-address", f"127.0.0.1:{runtime}")
        return name

    def flwr_run(self, name: str, app_dir: str | Path, run_config: dict) -> subprocess.Popen:
        """Submit the Flower App in ``app_dir`` with ``flwr run --stream`` (its output in
        ``NAME.log``); the process ends when the run does."""
        return self.start(name, "flwr", "run", str(app_dir), CONNECTION, "--stream", "--run-config", run_config_arg(run_config))

    def end(self, name: str, sig: int = signal.SIGTERM, grace: float = 15.0) -> None:
        """End process group ``name`` (and a SuperNode's ClientApp process, if it has one) with
        ``sig``, then SIGKILL what is left after ``grace`` s."""
        if f"{name}-clientapp" in self.processes:
            self.end(f"{name}-clientapp", sig, grace)
        process = self.processes[name]
        for s in (sig, signal.SIGKILL):
            try:
                os.killpg(process.pid, s)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + grace
            while group_alive(process.pid) and time.monotonic() < deadline:
                process.poll()  # reap the leader
                time.sleep(0.1)
            if not group_alive(process.pid):
                break
        process.wait()

    def close(self) -> list[int]:
        """End every process group (the last started first); return those still alive."""
        for name in reversed(list(self.processes)):
            self.end(name)
        return [p.pid for p in self.processes.values() if group_alive(p.pid)]

    def log(self, name: str, tail: int = 4000) -> str:
        return (self.folder / f"{name}.log").read_text()[-tail:]
