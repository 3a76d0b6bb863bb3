"""``beatflow serve`` (beatflow.pipeline.service): the state file, and a real service that a real
``beatflow run`` uses, from its start to ``--stop``."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from beatflow.pipeline import service as svc


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _state(**over) -> dict:
    return {"pid": os.getpid(), "api_url": "http://127.0.0.1:9/api", "scheduler": "tcp://127.0.0.1:9",
            "scheduler_http": "http://127.0.0.1:9", "device": "cpu", "workers": 1, "started": time.time(), **over}


# -- the state file -----------------------------------------------------------------------------------

def test_state_file_is_written_whole_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setenv("BEATFLOW_DATA_DIR", str(tmp_path / "data"))
    assert svc.data_dir() == tmp_path / "data"
    assert svc.read_state() is None
    path = svc.write_state(_state(workers=3))
    assert path == tmp_path / "data" / svc.STATE_NAME
    assert svc.read_state()["workers"] == 3
    svc.write_state(_state(workers=4))  # replaced, no temporary file left beside it
    assert svc.read_state()["workers"] == 4
    assert [p.name for p in path.parent.iterdir()] == [svc.STATE_NAME]
    path.write_text("{not json")
    assert svc.read_state() is None
    path.write_text(json.dumps({"pid": 1}))  # not a service's state
    assert svc.read_state() is None


def test_state_file_is_removed_only_for_its_own_pid(tmp_path, monkeypatch):
    monkeypatch.setenv("BEATFLOW_DATA_DIR", str(tmp_path))
    path = svc.write_state(_state(pid=12345))
    svc.remove_state(pid=999)
    assert path.exists()
    svc.remove_state(pid=12345)
    assert not path.exists()


def test_a_live_pid_counts_only_with_its_start_time():
    import psutil

    me = psutil.Process()
    assert svc.process_alive(_state(pid_created=me.create_time()))
    assert not svc.process_alive(_state(pid_created=me.create_time() - 100))  # a reused pid
    assert not svc.process_alive(_state(pid=_dead_pid()))


def test_a_stale_state_file_is_not_running_and_removed(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BEATFLOW_DATA_DIR", str(tmp_path))
    path = svc.write_state(_state(pid=_dead_pid()))
    assert svc.find_service() is None  # (what `beatflow run` asks: its own cluster)
    assert not path.exists()
    svc.write_state(_state(pid=_dead_pid()))
    assert svc.status() == svc.NOT_RUNNING
    assert "not running (removed the stale" in capsys.readouterr().out
    assert not path.exists()
    assert svc.status() == svc.NOT_RUNNING
    assert svc.stop() == svc.NOT_RUNNING


def test_a_live_process_that_does_not_answer_is_not_used(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("BEATFLOW_DATA_DIR", str(tmp_path))
    path = svc.write_state(_state())  # this process's pid, nothing listening at port 9
    assert svc.find_service(timeout=0.5) is None
    assert path.exists()  # not stale: it may be starting or stopping
    assert svc.status() == svc.NOT_RUNNING
    assert "does not serve" in capsys.readouterr().out


@pytest.mark.parametrize("value, off", [("", False), ("0", False), ("1", True), ("yes", True)])
def test_no_service_variable(monkeypatch, value, off):
    monkeypatch.setenv("BEATFLOW_NO_SERVICE", value)
    assert svc.service_disabled() is off


# -- a real service -------------------------------------------------------------------------------------

def _cli(*args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "beatflow.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    """``beatflow serve --workers 1`` in the foreground, in a data folder of its own."""
    data = tmp_path_factory.mktemp("service-data")
    env = {**os.environ, "BEATFLOW_DATA_DIR": str(data), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    env.pop("BEATFLOW_NO_SERVICE", None)
    proc = subprocess.Popen([sys.executable, "-m", "beatflow.cli", "serve", "--workers", "1", "--device", "cpu"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    path = data / svc.STATE_NAME
    t0 = time.monotonic()
    while not path.exists():
        if proc.poll() is not None:
            pytest.fail(f"beatflow serve exited with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() - t0 > 240:
            proc.kill()
            pytest.fail("beatflow serve did not start in 240 s")
        time.sleep(0.2)
    state = json.loads(path.read_text())
    yield SimpleNamespace(proc=proc, env=env, data=data, path=path, state=state)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # (Ctrl-C: a clean stop)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_service_status_says_where_it_is(service):
    st = service.state
    assert st["pid"] == service.proc.pid and st["device"] == "cpu" and st["workers"] == 1
    assert st["database"] == f"sqlite+aiosqlite:///{service.data / svc.DB_NAME}"
    r = _cli("serve", "--status", env=service.env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "running" in r.stdout and st["scheduler"] in r.stdout and st["api_url"] in r.stdout
    assert "(cpu, 1 worker(s))" in r.stdout


def test_a_second_service_is_refused_in_one_line(service):
    r = _cli("serve", "--workers", "1", env=service.env, timeout=60)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("beatflow: error: a beatflow service already runs") and str(service.proc.pid) in lines[0]
    assert service.proc.poll() is None and service.path.exists()


def test_run_uses_the_service(service, tmp_path):
    out = tmp_path / "out"
    logs = tmp_path / "logs"
    store = tmp_path / "store"
    r = _cli("run", "--hours", "0.04", "--epochs", "1", "--out", str(out), "--store", str(store),
             env={**service.env, "BEATFLOW_LOG_DIR": str(logs)})
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["service"] is True
    assert summary["device"] == "cpu" and summary["workers"] == 1  # the service's (this machine has more cores)
    (log,) = logs.glob("*-run.log")
    text = log.read_text()
    assert f"Connecting to an existing Dask cluster at {service.state['scheduler']}" in text  # no cluster of its own
    assert "Starting temporary server" not in text  # nor a Prefect server: the flow run is the service's API's
    import httpx

    def flow_runs():
        runs = httpx.post(service.state["api_url"] + "/flow_runs/filter", json={"limit": 10}, timeout=10).json()
        return sorted(fr["state_type"] for fr in runs)

    assert flow_runs() == ["COMPLETED"]
    # `beatflow score` reports to the service's API too (its flow needs no Dask cluster)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    shutil.copy(out / "input.npy", inbox / "rec.npy")
    r = _cli("score", "--inbox", str(inbox), "--store", str(store), env={**service.env, "BEATFLOW_LOG_DIR": str(logs)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "rec.npy" in r.stdout and (inbox / "done" / "rec.npy").exists()
    assert flow_runs() == ["COMPLETED", "COMPLETED"]
    assert not any("Starting temporary server" in p.read_text() for p in logs.glob("*-score.log"))


def test_what_the_commands_use_of_the_service(service, monkeypatch, capsys):
    from beatflow.cli import _find_service

    monkeypatch.setenv("BEATFLOW_DATA_DIR", str(service.data))
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    monkeypatch.delenv("BEATFLOW_NO_SERVICE", raising=False)
    args = SimpleNamespace(no_service=False, scheduler=None)
    assert _find_service(args, "auto")["scheduler"] == service.state["scheduler"]
    assert _find_service(args, "cpu")["workers_now"] == 1
    assert _find_service(SimpleNamespace(no_service=True, scheduler=None)) is None
    assert _find_service(SimpleNamespace(no_service=False, scheduler="tcp://127.0.0.1:1")) is None  # explicit
    monkeypatch.setenv("PREFECT_API_URL", "http://127.0.0.1:9/api")  # another API: the service's workers do not talk to it
    assert _find_service(args, "auto") is None
    monkeypatch.setenv("PREFECT_API_URL", service.state["api_url"])
    assert _find_service(args, "auto") is not None
    capsys.readouterr()
    assert _find_service(args, "gpu") is None  # another device: the command's own cluster, and it says so
    assert "runs on the cpu; this --device gpu run starts its own cluster" in capsys.readouterr().err
    monkeypatch.setenv("BEATFLOW_NO_SERVICE", "1")
    assert _find_service(args, "auto") is None


def test_stop_ends_the_service(service):
    r = _cli("serve", "--stop", env=service.env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"stopped (pid {service.proc.pid})" in r.stdout
    assert service.proc.wait(timeout=30) is not None
    assert not service.path.exists()
    said = service.proc.stdout.read().splitlines()
    assert said[0] == "beatflow serve: ready (Ctrl-C stops it)" and said[-1] == "beatflow serve: stopped"
    r = _cli("serve", "--status", env=service.env, timeout=60)
    assert r.returncode == 3 and "not running" in r.stdout
    r = _cli("serve", "--stop", env=service.env, timeout=60)
    assert r.returncode == 3 and "not running" in r.stdout
