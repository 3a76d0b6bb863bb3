"""The Prefect server on PostgreSQL (``PREFECT_API_DATABASE_CONNECTION_URL``) instead of SQLite.

Starts a throw-away PostgreSQL cluster (Debian's ``postgresql`` package, which ``.ci/run`` installs),
a real ``prefect server start`` on it, runs the flow against that server, and finds the completed
run in PostgreSQL's own tables. Skipped where PostgreSQL's server binaries are not installed.
"""
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import ROOT, _free_port, run_cli

BINDIRS = sorted(glob.glob("/usr/lib/postgresql/*/bin"))


def _as_postgres(cmd, **kw):
    """Run a PostgreSQL command as the ``postgres`` user when we are root (initdb refuses root)."""
    if os.geteuid() == 0:
        cmd = ["runuser", "-u", "postgres", "--", *cmd]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, **kw)


@pytest.fixture
def postgres_url():
    if not BINDIRS:
        pytest.skip("PostgreSQL server binaries not installed (apt-get install postgresql)")
    bindir = Path(BINDIRS[-1])
    root = Path(tempfile.mkdtemp(prefix="beatflow-pg-", dir="/tmp"))
    os.chmod(root, 0o777)
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres")
    port = _free_port()
    r = _as_postgres([str(bindir / "initdb"), "-D", str(data), "-U", "beatflow", "--auth=trust", "-E", "UTF8"])
    assert r.returncode == 0, r.stderr
    opts = f"-p {port} -k {root} -c listen_addresses=127.0.0.1"
    r = _as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-o", opts, "-l", str(root / "log"), "-w", "start"])
    assert r.returncode == 0, r.stderr + (root / "log").read_text()
    try:
        r = _as_postgres([str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "beatflow", "prefect"])
        assert r.returncode == 0, r.stderr
        yield f"postgresql+asyncpg://beatflow@127.0.0.1:{port}/prefect", (bindir, port)
    finally:
        _as_postgres([str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "stop"])
        shutil.rmtree(root, ignore_errors=True)


def test_prefect_server_on_postgres_runs_the_flow(postgres_url, tmp_path):
    import httpx

    url, (bindir, pg_port) = postgres_url
    port = _free_port()
    env = {**os.environ, "PREFECT_API_DATABASE_CONNECTION_URL": url, "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_HOME": str(tmp_path / "prefect-home"), "PREFECT_UI_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                               str(port)], env=env, stdout=open(tmp_path / "server.log", "w"),
                              stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api"
    try:
        deadline = time.time() + 180
        while True:
            try:
                if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-3000:]
            assert time.time() < deadline, "server did not start"
            time.sleep(1)
        r = run_cli(["run", "--hours", "0.05", "--epochs", "1", "--device", "cpu", "--workers", "2", "--out",
                     tmp_path / "out"], api)
        assert r.returncode == 0, r.stderr[-3000:]
        assert (tmp_path / "out" / "summary.json").exists()
        # the run is in PostgreSQL, not in a SQLite file
        q = _as_postgres([str(bindir / "psql"), "-h", "127.0.0.1", "-p", str(pg_port), "-U", "beatflow", "-d",
                          "prefect", "-At", "-c",
                          "select count(*) from flow_run where state_type = 'COMPLETED'"])
        assert q.returncode == 0 and int(q.stdout.strip()) >= 1, q.stdout + q.stderr
        assert not list((tmp_path / "prefect-home").glob("*.db"))
    finally:
        server.terminate()
        server.wait(timeout=30)
