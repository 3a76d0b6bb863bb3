"""What a plain ``beatflow run`` does before and around its flow: the temporary Prefect API server started
first (:mod:`beatflow.pipeline.api_server`) and the run cache on by default
(:func:`beatflow.pipeline.caching.run_cache`)."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from beatflow.errors import BeatflowError
from beatflow.pipeline import api_server
from beatflow.pipeline.caching import run_cache

ROOT = Path(__file__).resolve().parents[1]


# --- the run cache's folder ---------------------------------------------------------------------------

@pytest.mark.parametrize("value", ["off", "OFF", "none", "0", "false", "", " no "])
def test_run_cache_off(value, monkeypatch):
    monkeypatch.delenv("BEATFLOW_CACHE", raising=False)
    assert run_cache(value) is None
    monkeypatch.setenv("BEATFLOW_CACHE", value)
    assert run_cache() is None


def test_run_cache_folder_from_option_variable_or_user_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("BEATFLOW_CACHE", str(tmp_path / "env"))
    assert run_cache(str(tmp_path / "opt")) == str(tmp_path / "opt")  # the option first
    assert run_cache() == str(tmp_path / "env")
    monkeypatch.delenv("BEATFLOW_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert run_cache() == str(tmp_path / "xdg" / "beatflow" / "runs")


# --- the early server ------------------------------------------------------------------------------

def test_wanted_only_where_nothing_names_an_api(tmp_path, monkeypatch):
    for var in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))
    assert api_server.wanted()  # no profiles file
    (tmp_path / "profiles.toml").write_text('active = "default"\n[profiles.default]\n')
    assert api_server.wanted()
    (tmp_path / "profiles.toml").write_text('[profiles.default]\nPREFECT_API_URL = "http://x:4200/api"\n')
    assert not api_server.wanted()
    (tmp_path / "profiles.toml").unlink()
    monkeypatch.setenv("PREFECT_PROFILE", "other")
    assert not api_server.wanted()
    monkeypatch.delenv("PREFECT_PROFILE")
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")
    assert not api_server.wanted()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def test_early_server_answers_then_stops(monkeypatch, tmp_path):
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path))  # (its database: a throw-away one)
    server = api_server.start_early()
    try:
        url = server.wait()
        assert url == server.api_url and _answers(url)
        assert 0 < server.ready_after_s < api_server.START_TIMEOUT_S
        assert os.getpgid(server.proc.pid) == server.proc.pid  # a session of its own: a Ctrl-C does not reach it
    finally:
        server.stop()
    assert server.proc.poll() is not None and not _answers(url)
    server.stop()  # (again: nothing to do)


def test_a_server_that_exits_is_one_clear_error():
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    server = api_server.EarlyServer(proc, 9)
    with pytest.raises(BeatflowError, match="exited with status 3 before it answered"):
        server.wait(timeout=30)


def test_a_server_that_never_answers_is_stopped():
    with socket.socket() as s:  # a port that nothing answers on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    server = api_server.EarlyServer(proc, port)
    with pytest.raises(BeatflowError, match="did not answer within 1 s"):
        server.wait(timeout=1)
    assert proc.poll() is not None  # stopped, not left behind


# --- a plain run: the early server used and gone, the second run served from the default cache ----------

def _plain_run(out: Path, home: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "BEATFLOW_CACHE", "PREFECT_PROFILE")}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(home / "prefect"), XDG_CACHE_HOME=str(home / "cache"),
               BEATFLOW_NO_SERVICE="1")
    return subprocess.run([sys.executable, "-m", "beatflow.cli", "run", "--hours", "0.05", "--epochs", "1",
                           "--device", "cpu", "--workers", "1", "--out", str(out), "--verbose"],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_plain_run_uses_the_early_server_and_the_default_cache(tmp_path):
    first = _plain_run(tmp_path / "a", tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    log = first.stdout + first.stderr
    assert "Starting temporary server" not in log  # (Prefect's own, started late: not used)
    url = re.search(r"Prefect API (http://127\.0\.0\.1:\d+/api): the run's temporary server", log).group(1)
    assert not _answers(url)  # stopped with the command
    assert (tmp_path / "cache" / "beatflow" / "runs").is_dir()
    second = _plain_run(tmp_path / "b", tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    cached = [ln for ln in (second.stdout + second.stderr).splitlines() if "Finished in state Cached" in ln]
    assert [ln for ln in cached if "Task run 'train-vae-" in ln], cached
    a, b = (json.loads((tmp_path / d / "summary.json").read_text()) for d in ("a", "b"))
    assert a["train_loss"] == b["train_loss"] and a["anomalies_flagged"] == b["anomalies_flagged"]


# --- the background server: started by one run, used by the next, gone once idle -----------------------

@pytest.mark.parametrize("raw, value", [("", api_server.DEFAULT_LINGER_S), ("0", 0.0), (" 30 ", 30.0), ("1.5", 1.5)])
def test_linger_from_the_environment(raw, value, monkeypatch):
    monkeypatch.setenv(api_server.LINGER_VAR, raw)
    assert api_server.linger_s() == value


@pytest.mark.parametrize("raw", ["soon", "-1", "inf", "nan"])
def test_a_bad_linger_is_one_clear_error(raw, monkeypatch):
    from beatflow.errors import InputError

    monkeypatch.setenv(api_server.LINGER_VAR, raw)
    with pytest.raises(InputError, match=rf"^BEATFLOW_API_LINGER_S='{re.escape(raw)}': not a number of seconds"):
        api_server.linger_s()


@pytest.fixture
def data_folder(tmp_path, monkeypatch):
    """A data folder and a Prefect home of its own; every background server started in it is stopped."""
    monkeypatch.setenv("BEATFLOW_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    started = []
    yield tmp_path / "data", started
    import psutil

    for pid in started:
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def _gone(pid: int, within: float) -> bool:
    import time

    import psutil

    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.1)
    return False


def test_the_background_server_is_used_again_then_stops_when_idle(data_folder, monkeypatch):
    import time

    folder, started = data_folder
    first = api_server.background(linger=3.0)
    started.append(first.state["pid"])
    url = first.wait()
    assert _answers(url) and first.proc is not None
    assert os.getpgid(first.state["pid"]) == first.state["pid"]  # a session of its own: a Ctrl-C does not reach it
    first.stop()
    second = api_server.background(linger=3.0)  # the same server, at once
    assert second.proc is None and second.state["pid"] == first.state["pid"] and second.wait(timeout=5) == url
    assert second.ready_after_s < 1.0
    time.sleep(5.0)  # longer than its linger: the lease held keeps it up
    assert _answers(url)
    second.stop()
    assert _gone(first.state["pid"], within=15.0)  # no lease: it stops after its linger
    assert not (folder / api_server.STATE_NAME).exists() and not Path(first.state["lease"]).exists()
    third = api_server.background(linger=3.0)  # a new one
    started.append(third.state["pid"])
    assert third.proc is not None and third.state["pid"] != first.state["pid"]
    third.wait()
    third.stop()


def test_a_dead_or_foreign_background_server_is_not_used(data_folder, monkeypatch):
    folder, started = data_folder
    first = api_server.background(linger=60.0)
    started.append(first.state["pid"])
    first.wait()
    first.stop()
    monkeypatch.setattr(api_server, "server_key", lambda: "another-python")  # another Python, Prefect or database
    other = api_server.background(linger=60.0)
    started.append(other.state["pid"])
    assert other.proc is not None and other.state["pid"] != first.state["pid"]
    other.wait()
    other.stop()
    import psutil

    psutil.Process(other.state["pid"]).kill()  # killed: its state file stays, naming a dead process
    assert _gone(other.state["pid"], within=10.0)
    assert (folder / api_server.STATE_NAME).exists()
    third = api_server.background(linger=60.0)
    started.append(third.state["pid"])
    assert third.proc is not None and third.state["pid"] not in (first.state["pid"], other.state["pid"])
    assert third.wait() == third.api_url
    third.stop()


def test_two_plain_runs_share_the_background_server(tmp_path):
    import psutil

    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "PREFECT_PROFILE")}
    env.update(PYTHONPATH=str(ROOT), PREFECT_HOME=str(tmp_path / "prefect"), BEATFLOW_DATA_DIR=str(tmp_path / "data"),
               BEATFLOW_NO_SERVICE="1", BEATFLOW_API_LINGER_S="120")
    urls = []
    try:
        for name in ("a", "b"):
            run = subprocess.run([sys.executable, "-m", "beatflow.cli", "run", "--hours", "0.05", "--epochs", "1",
                                  "--device", "cpu", "--workers", "1", "--out", str(tmp_path / name), "--verbose"],
                                 capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
            assert run.returncode == 0, run.stderr[-3000:]
            log = run.stdout + run.stderr
            urls.append(re.search(r"Prefect API (http://127\.0\.0\.1:\d+/api): the background server \((started by "
                                  r"this run|pid \d+)", log))
            assert (tmp_path / name / "summary.json").is_file()
        assert urls[0].group(2) == "started by this run" and urls[1].group(2).startswith("pid ")
        assert urls[0].group(1) == urls[1].group(1) and _answers(urls[0].group(1))  # still up for the next run
    finally:
        state = api_server._read(tmp_path / "data" / api_server.STATE_NAME)
        if state is not None:
            psutil.Process(state["pid"]).kill()
