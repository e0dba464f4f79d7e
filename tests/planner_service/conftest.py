"""Fixtures of the service's tests: a private PostgreSQL cluster that a test may stop, freeze or kill (the fault
tests); the service with two job workers that the sweep tests send their sweeps to."""

from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from planner_service.embedded import EmbeddedServer, free_port


def _pg_bin() -> str | None:
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"))
    return str(Path(found[-1]).parent) if found else None


@dataclass
class PrivateCluster:
    """A throw-away PostgreSQL cluster on its own port: stopping or freezing it disturbs nobody else (never
    do either to the shared server the other tests use)."""

    url: str
    bindir: str
    data: Path
    port: int
    run_as: list[str]
    sockdir: Path

    def _ctl(self, action: str, *extra: str) -> None:
        opts = f"-p {self.port} -k {self.sockdir} -c listen_addresses=127.0.0.1"
        subprocess.run(
            [
                *self.run_as,
                f"{self.bindir}/pg_ctl",
                "-D",
                str(self.data),
                "-l",
                str(self.sockdir / "pg.log"),
                "-o",
                opts,
                "-w",
                *extra,
                action,
            ],
            check=True,
            capture_output=True,
        )

    def start(self) -> None:
        self._ctl("start")

    def stop(self) -> None:
        self._ctl("stop")

    def processes(self) -> list[int]:
        """The postmaster and every process it started."""
        postmaster = int((self.data / "postmaster.pid").read_text().split()[0])
        children = []
        for status in glob.glob("/proc/[0-9]*/status"):
            try:
                fields = dict(
                    line.split(":\t", 1) for line in Path(status).read_text().splitlines() if ":\t" in line
                )
            except OSError:
                continue
            if int(fields.get("PPid", "0").strip()) == postmaster:
                children.append(int(fields["Pid"].strip()))
        return [postmaster, *children]

    def freeze(self) -> None:
        """SIGSTOP the whole cluster: connections stay open, nothing answers."""
        for pid in self.processes():
            os.kill(pid, signal.SIGSTOP)

    def thaw(self) -> None:
        for pid in self.processes():
            os.kill(pid, signal.SIGCONT)


@pytest.fixture
def private_postgres_cluster() -> Iterator[PrivateCluster]:
    bindir = _pg_bin()
    if bindir is None:
        if os.environ.get("CI"):
            pytest.fail(
                "PostgreSQL server binaries are required in CI (scripts/ensure_postgres.sh installs them)"
            )
        pytest.skip("PostgreSQL server binaries not installed")
    tmp_path = Path(tempfile.mkdtemp(prefix="memplan-pg-"))  # not under pytest's 0700 root-owned tree
    run_as: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        run_as = ["runuser", "-u", "postgres", "--"]
        tmp_path.chmod(0o777)
    data = tmp_path / "pgdata"
    subprocess.run(
        [*run_as, f"{bindir}/initdb", "-D", str(data), "-U", "postgres", "-A", "trust"],
        check=True,
        capture_output=True,
    )
    port = free_port()
    cluster = PrivateCluster(
        f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", bindir, data, port, run_as, tmp_path
    )
    cluster.start()
    try:
        yield cluster
    finally:
        try:
            cluster.thaw()
        except (OSError, ValueError):
            pass
        subprocess.run(
            [*run_as, f"{bindir}/pg_ctl", "-D", str(data), "-m", "immediate", "stop"], capture_output=True
        )
        shutil.rmtree(tmp_path, ignore_errors=True)


@pytest.fixture
def sweep_service(settings) -> Iterator[str]:  # type: ignore[no-untyped-def]
    """The real app on a loopback port with two job workers, which solve a sweep's plans side by side (the
    sweep tests under whatif/ and ui/)."""
    with EmbeddedServer(settings, workers=2) as url:
        yield url
