"""``beatflow run`` handed to a ready runner of ``beatflow serve`` (beatflow.pipeline.handoff,
beatflow.pipeline.runner): the same outputs and exit statuses as a command that runs itself, Ctrl-C,
a killed runner, the fallback where no runner is ready, stale runner files, ``--status`` and ``--stop``."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from beatflow.pipeline import handoff
from beatflow.pipeline import service as svc

SMALL = ("--hours", "0.1", "--epochs", "1", "--cache", "off")


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# -- the client's choices, without a service ---------------------------------------------------------

@pytest.fixture
def fake_service(tmp_path, monkeypatch):
    """A data folder whose state file names this (live) process as the service."""
    monkeypatch.setenv("BEATFLOW_DATA_DIR", str(tmp_path))
    for var in ("PREFECT_API_URL", "BEATFLOW_NO_SERVICE", "BEATFLOW_NO_HANDOFF"):
        monkeypatch.delenv(var, raising=False)
    svc.write_state({"pid": os.getpid(), "api_url": "http://127.0.0.1:9/api", "scheduler": "tcp://127.0.0.1:9",
                     "scheduler_http": "http://127.0.0.1:9", "device": "cpu", "workers": 1})
    return tmp_path


def _runner_state(pid, sock, **over):
    return {"pid": pid, "service_pid": os.getpid(), "socket": str(sock), "state": "ready", "since": time.time(),
            "prefect_env": handoff.prefect_env(os.environ), **over}


def test_no_runner_ready_the_command_runs_itself(fake_service):
    assert handoff.try_handoff(["run", "--hours", "0.1"]) is None
    svc.write_runner(_runner_state(os.getpid(), svc.socket_path(os.getpid()), state="busy"))
    assert handoff.try_handoff(["run", "--hours", "0.1"]) is None  # (a busy runner is not asked)


def test_a_dead_runners_socket_is_ignored_and_removed(fake_service):
    pid = _dead_pid()
    sock_path = svc.socket_path(pid)
    sock_path.parent.mkdir(parents=True, exist_ok=True)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(sock_path))  # a socket file nobody listens on, as a killed runner leaves it
    s.close()
    svc.write_runner(_runner_state(pid, sock_path))
    assert handoff.try_handoff(["run", "--hours", "0.1"]) is None
    assert not svc.runner_path(pid).exists() and not sock_path.exists()


def test_a_runner_that_does_not_accept_is_passed_over(fake_service):
    """A live runner that takes the connection and closes it (another client's command got it first)."""
    sock_path = svc.socket_path(os.getpid())
    sock_path.parent.mkdir(parents=True, exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock_path))
    srv.listen(1)
    svc.write_runner(_runner_state(os.getpid(), sock_path))
    import threading

    def refuse():
        conn, _ = srv.accept()
        conn.close()

    t = threading.Thread(target=refuse)
    t.start()
    assert handoff.try_handoff(["run", "--hours", "0.1"]) is None
    t.join(5)
    srv.close()
    assert svc.runner_path(os.getpid()).exists()  # (alive: its files stay, it is its own to remove)


@pytest.mark.parametrize("argv, env", [
    (["run", "--no-service"], {}), (["run", "--scheduler", "tcp://127.0.0.1:1"], {}), (["run", "--sched=x"], {}),
    (["run", "--device", "gpu"], {}), (["run", "--dev=gpu"], {}),  # (the service runs on the cpu)
    (["serve", "--status"], {}), (["evaluate"], {}), (["run"], {"BEATFLOW_NO_HANDOFF": "1"}),
    (["run"], {"BEATFLOW_NO_SERVICE": "1"}), (["run"], {"PREFECT_API_URL": "http://127.0.0.1:1/api"}),
    (["run"], {"PREFECT_LOGGING_LEVEL": "DEBUG"}),  # a Prefect setting the runner did not import with
])
def test_what_is_not_handed_off(fake_service, monkeypatch, argv, env):
    """A runner that would accept anything is there; these commands are not handed to it."""
    sock_path = svc.socket_path(os.getpid())
    sock_path.parent.mkdir(parents=True, exist_ok=True)
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(str(sock_path))
    srv.listen(1)
    srv.settimeout(0.2)
    svc.write_runner(_runner_state(os.getpid(), sock_path))
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    try:
        assert handoff.try_handoff(argv) is None
        with pytest.raises(TimeoutError):
            srv.accept()  # (nobody connected)
    finally:
        srv.close()


# -- a real service and its runners -----------------------------------------------------------------------

def _cli(*args, env, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "beatflow.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def _runners(data) -> list[dict]:
    return [json.loads(p.read_text()) for p in (data / svc.RUNNERS_DIR).glob("*.json")]


def _ready_runner(data, timeout=180) -> dict:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        ready = [r for r in _runners(data) if r["state"] == "ready"]
        if ready:
            return ready[0]
        time.sleep(0.2)
    pytest.fail(f"no runner ready in {timeout} s")


def _log_pid(logs) -> int:
    (log,) = logs.glob("*-run.log")
    return int(log.name.split("-")[2])


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    data = tmp_path_factory.mktemp("handoff-data")
    env = {**os.environ, "BEATFLOW_DATA_DIR": str(data), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    for var in ("PREFECT_API_URL", "BEATFLOW_NO_SERVICE", "BEATFLOW_NO_HANDOFF"):
        env.pop(var, None)
    proc = subprocess.Popen([sys.executable, "-m", "beatflow.cli", "serve", "--workers", "1", "--device", "cpu"],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while not (data / svc.STATE_NAME).exists():
        if proc.poll() is not None:
            pytest.fail(f"beatflow serve exited with {proc.returncode}: {proc.stderr.read()}")
        if time.monotonic() - t0 > 240:
            proc.kill()
            pytest.fail("beatflow serve did not start in 240 s")
        time.sleep(0.2)
    yield SimpleNamespace(proc=proc, env=env, data=data)
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_status_shows_the_ready_runner(service):
    runner = _ready_runner(service.data)
    r = _cli("serve", "--status", env=service.env, timeout=60)
    assert r.returncode == 0, r.stderr
    assert f"runner pid {runner['pid']}: ready for" in r.stdout


def test_a_run_through_the_runner_gives_what_a_run_of_its_own_gives(service, tmp_path):
    runner = _ready_runner(service.data)
    summaries, rows = {}, {}
    for how, extra in (("handoff", {}), ("itself", {"BEATFLOW_NO_HANDOFF": "1"})):
        out, logs = tmp_path / how, tmp_path / f"logs-{how}"
        r = _cli("run", *SMALL, "--out", str(out), env={**service.env, "BEATFLOW_LOG_DIR": str(logs), **extra})
        assert r.returncode == 0, r.stderr[-3000:]
        assert r.stderr == "", r.stderr
        rows[how] = [line.split("│")[1].strip() for line in r.stdout.splitlines() if line.startswith("│")]
        summaries[how] = json.loads((out / "summary.json").read_text())
        if how == "handoff":
            assert _log_pid(logs) == runner["pid"]  # the runner ran it, and wrote the run's log
            assert _wait_gone(runner["pid"])  # (one command, then it ends)
        else:
            assert _log_pid(logs) != runner["pid"]
    assert rows["handoff"] == rows["itself"] and "outputs" in rows["handoff"]  # the same table
    a, b = summaries["handoff"], summaries["itself"]
    assert a["service"] is True and b["service"] is True
    for k in ("samples", "fs", "beats_detected", "beats_kept", "device", "workers"):
        assert a[k] == b[k], k
    assert sorted(p.name for p in (tmp_path / "handoff").iterdir()) == sorted(p.name for p in (tmp_path / "itself").iterdir())


def test_score_through_the_runner(service, tmp_path):
    import shutil

    store, logs = tmp_path / "store", tmp_path / "logs"
    r = _cli("run", *SMALL, "--out", str(tmp_path / "out"), "--store", str(store), env=service.env)
    assert r.returncode == 0, r.stderr[-3000:]
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    shutil.copy(tmp_path / "out" / "input.npy", inbox / "rec.npy")
    runner = _ready_runner(service.data)
    r = _cli("score", "--inbox", str(inbox), "--store", str(store), env={**service.env, "BEATFLOW_LOG_DIR": str(logs)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith("done      rec.npy: ") and (inbox / "done" / "rec.npy").exists()
    (log,) = logs.glob("*-score.log")
    assert int(log.name.split("-")[2]) == runner["pid"]


def _wait_gone(pid, timeout=30) -> bool:
    t0 = time.monotonic()
    while svc.pid_alive(pid):
        if time.monotonic() - t0 > timeout:
            return False
        time.sleep(0.1)
    return True


def test_bad_input_through_the_runner_is_one_line_and_leaves_nothing(service, tmp_path):
    runner = _ready_runner(service.data)
    out = tmp_path / "out"
    r = _cli("run", "--hours", "-1", "--out", str(out), env=service.env, timeout=60)
    assert r.returncode == 2
    assert r.stderr.splitlines() == ["beatflow: error: --hours -1: the synthetic ECG's length must be between "
                                     "0.0333 h (two minutes) and 10000 h"]
    assert r.stdout == "" and not out.exists()
    assert _wait_gone(runner["pid"])  # (it was the runner's answer)


def _started_run(service, out) -> subprocess.Popen:
    """A 0.5 h run (its own training: no cache) through the service, once its output folder is being written."""
    p = subprocess.Popen([sys.executable, "-m", "beatflow.cli", "run", "--hours", "0.5", "--epochs", "5", "--cache",
                          "off", "--out", str(out)], env=service.env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    _wait_for_partial(out)
    return p


def test_ctrl_c_stops_the_runners_run(service, tmp_path):
    runner = _ready_runner(service.data)
    out = tmp_path / "out"
    p = _started_run(service, out)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 130, err
    assert err.splitlines()[-1] == "beatflow: interrupted"
    assert not out.exists() and not list(tmp_path.glob(".out.*.partial"))
    assert _wait_gone(runner["pid"])


def test_a_killed_runner_leaves_no_partial_output(service, tmp_path):
    runner = _ready_runner(service.data)
    out = tmp_path / "out"
    p = _started_run(service, out)
    os.kill(runner["pid"], signal.SIGKILL)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 1, err
    assert err.splitlines() == [f"beatflow: error: the service's runner (pid {runner['pid']}) ended before the "
                                f"command did; removed its partial output {next(iter(_partials_seen))}"]
    assert not out.exists() and not list(tmp_path.glob(".out.*.partial"))


_partials_seen: list = []


def _wait_for_partial(out, timeout=120) -> None:
    t0 = time.monotonic()
    while not (found := list(out.parent.glob(f".{out.name}.*.partial"))):
        if time.monotonic() - t0 > timeout:
            pytest.fail("the run did not start writing")
        time.sleep(0.1)
    _partials_seen[:] = found


def test_stop_stops_the_runners(service):
    runner = _ready_runner(service.data)
    r = _cli("serve", "--stop", env=service.env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert service.proc.wait(timeout=30) is not None
    assert _wait_gone(runner["pid"], timeout=10)
    assert not list((service.data / svc.RUNNERS_DIR).glob("*.json"))
    assert not list((service.data / svc.RUNNERS_DIR).glob("*.sock"))
