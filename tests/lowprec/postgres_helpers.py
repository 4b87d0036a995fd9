"""A private PostgreSQL cluster for the tracking tests: Debian's `postgresql` binaries,
`initdb` into a temporary folder, `pg_ctl start` on a free port on 127.0.0.1, one database.

PostgreSQL refuses to run as root; as root the cluster belongs to the `postgres` system
user (the Debian package creates it) and its folder is made for that user. `missing()`
says why no cluster can be started here (the fixture skips with that reason).
"""

from __future__ import annotations

import glob
import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

USER = "lowprec"      # the cluster's superuser (trust authentication, 127.0.0.1 only)
INSTALL_HINT = ("`make test` installs it where apt-get can (root): "
                "apt-get install -y -q postgresql")


def bindir() -> Path | None:
    """The folder of Debian's PostgreSQL server binaries (newest version), or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[4]))
    if found:
        return Path(found[-1]).parent
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb else None


def missing() -> str | None:
    """Why a cluster cannot be started here, or None."""
    if bindir() is None:
        return f"PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb); {INSTALL_HINT}"
    try:
        import psycopg2  # noqa: F401  (MLflow's postgresql:// backend needs it)
    except ImportError:
        return "psycopg2 is not installed (MLflow's postgresql backend needs it): pip install -e '.[dev]'"
    if os.geteuid() == 0:
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            return "running as root and there is no `postgres` user to run the PostgreSQL server as"
    return None


class PostgresCluster:
    """`initdb` + `pg_ctl start` in a new temporary folder; `uri(db)` for MLflow; `stop()`."""

    def __init__(self, port: int, database: str = "mlflow"):
        self.port, self.database, self.bin = port, database, bindir()
        self.root = Path(tempfile.mkdtemp(prefix="lowprec-pg-"))
        self.data, self.log = self.root / "data", self.root / "server.log"
        self._as: dict = {}
        if os.geteuid() == 0:   # the server refuses root: it runs as the `postgres` user
            pw = pwd.getpwnam("postgres")
            os.chown(self.root, pw.pw_uid, pw.pw_gid)
            self._as = {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}
        self.started = False

    def _run(self, *args: str, timeout: float = 60) -> None:
        out = subprocess.run([str(self.bin / args[0]), *args[1:]], capture_output=True, text=True,
                             timeout=timeout, cwd=self.root, **self._as)
        if out.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"{' '.join(args[:2])} failed ({out.returncode}): {out.stderr[-2000:]}\n{log}")

    def start(self) -> "PostgresCluster":
        t = time.monotonic()
        self._run("initdb", "-D", str(self.data), "-U", USER, "--auth=trust", "-E", "UTF8",
                  "--locale=C", "--no-sync")
        # fsync off and a socket in the cluster's folder: a throwaway cluster, nothing system-wide
        opts = (f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
                f"-c synchronous_commit=off -c full_page_writes=off")
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", opts, "-w", "-t", "60", "start")
        self.started = True
        self._run("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", USER, self.database)
        self.start_seconds = time.monotonic() - t
        return self

    def uri(self) -> str:
        """MLflow's backend store URI; the driver is named (SQLAlchemy 2.1 defaults to psycopg 3)."""
        return f"postgresql+psycopg2://{USER}@127.0.0.1:{self.port}/{self.database}"

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its folder; idempotent."""
        if self.started:
            try:
                self._run("pg_ctl", "-D", str(self.data), "-m", "fast", "-w", "-t", "30", "stop")
            finally:
                self.started = False
        shutil.rmtree(self.root, ignore_errors=True)
