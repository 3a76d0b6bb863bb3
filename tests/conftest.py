import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
MITDB = ROOT.parent / "shared" / "data" / "mitdb"
# engines built by tests (the commands' run logs, and the data folder where `beatflow serve` writes its state, so
# that no service of the user's is used) go to a throw-away cache (inherited by CLI subprocesses and Dask workers),
# removed when the session ends (the ones this session made, not caches given from outside)
_THROWAWAY = []
for _var, _prefix in (("BEATFLOW_CACHE_DIR", "beatflow-engine-cache-"), ("BEATFLOW_SYNTH_CACHE", "beatflow-synth-cache-"),
                      ("BEATFLOW_LOG_DIR", "beatflow-logs-"), ("BEATFLOW_DATA_DIR", "beatflow-data-")):
    if _var not in os.environ:
        os.environ[_var] = tempfile.mkdtemp(prefix=_prefix)
        _THROWAWAY.append(os.environ[_var])
# no run cache (`beatflow run --cache`'s default folder) unless a test names one
os.environ.setdefault("BEATFLOW_CACHE", "off")
# no background Prefect server left behind by a test's run (tests/test_run_start.py tests it on its own data folders)
os.environ.setdefault("BEATFLOW_API_LINGER_S", "0")


def pytest_sessionfinish(session, exitstatus):
    import shutil

    for path in _THROWAWAY:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def mitdb() -> Path:
    if not (MITDB / "101.hea").exists():
        pytest.skip("MIT-BIH records not found at ../shared/data/mitdb")
    return MITDB


@pytest.fixture(scope="session")
def synthetic_ecg():
    from beatflow.io.synth import synthesize_ecg

    return synthesize_ecg(hours=0.1, fs=250.0, seed=3)


@pytest.fixture(scope="session")
def prefect_server():
    """One real Prefect API server (127.0.0.1, free port) for the tests that run flows."""
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    server = SubprocessASGIServer(port=_free_port())
    server.start(timeout=120)
    with temporary_settings(updates={PREFECT_API_URL: server.api_url}):
        yield server.api_url
        from beatflow.pipeline.cluster import _flush_logs

        _flush_logs()
    server.stop()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cli(args, api_url, cwd=None, timeout=900):
    """Run the ``beatflow`` command in a subprocess against the test server."""
    import subprocess

    env = {**os.environ, "PREFECT_API_URL": api_url, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "beatflow.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd or ROOT, timeout=timeout)
