"""What the terminal shows (one line on error, the rest in the run's log) and how a command stops on
Ctrl-C or SIGTERM: within 5 s, ``beatflow: interrupted``, exit 130/143, no processes, nothing at --out."""
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT


def _python(code: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def test_the_run_log_takes_standard_error_of_the_process_and_its_children(tmp_path):
    code = (
        "import subprocess, sys\n"
        "from beatflow.terminal import RunLog, say\n"
        "with RunLog('t') as log:\n"
        "    print('from python', file=sys.stderr)\n"
        "    subprocess.run([sys.executable, '-c', 'import sys; sys.stderr.write(\"from a child\\\\n\")'])\n"
        "    say('to the terminal')\n"
        "    path = log.path\n"
        "print('after', file=sys.stderr)\n"
        "print(path)\n"
    )
    r = _python(code, {"BEATFLOW_LOG_DIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr
    assert r.stderr == "to the terminal\nafter\n"
    log = Path(r.stdout.strip())
    assert log.parent == tmp_path and log.read_text() == "from python\nfrom a child\n"


def test_the_run_log_keeps_the_latest_logs_only(tmp_path):
    from beatflow.terminal import KEEP_LOGS

    for k in range(KEEP_LOGS + 5):
        p = tmp_path / f"old-{k:03d}.log"
        p.write_text("x")
        os.utime(p, (1000 + k, 1000 + k))
    r = _python("from beatflow.terminal import RunLog\nwith RunLog('t'):\n    pass\n", {"BEATFLOW_LOG_DIR": str(tmp_path)})
    assert r.returncode == 0
    left = sorted(p.name for p in tmp_path.glob("*.log"))
    assert len(left) == KEEP_LOGS + 1 and "old-000.log" not in left and "old-054.log" in left


def _session_processes(sid: int) -> list:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getsid(p.pid) == sid:
                out.append(p)
        except (ProcessLookupError, PermissionError):
            pass
    return out


def _descendants_alive(pids) -> list[int]:
    return [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _start(args, tmp_path):
    """``beatflow`` in a session of its own (a terminal's process group), with a temporary Prefect server
    of its own (no PREFECT_API_URL): what a user's terminal runs."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.Popen([sys.executable, "-m", "beatflow.cli", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path, start_new_session=True)


def _wait_for(cond, proc, timeout=240):
    t0 = time.time()
    while not cond():
        assert proc.poll() is None, proc.communicate()
        assert time.time() - t0 < timeout, "the run never got there"
        time.sleep(0.05)


@pytest.mark.parametrize("sig,code,when", [
    (signal.SIGINT, 130, "load"),       # Ctrl-C while the workers read the stream
    (signal.SIGINT, 130, "training"),   # Ctrl-C during training
    (signal.SIGTERM, 143, "training"),  # a scheduler's or a shell's kill
])
def test_an_interrupted_run_stops_quickly_and_leaves_nothing(tmp_path, sig, code, when):
    out = tmp_path / "out"
    p = _start(["run", "--hours", "0.2", "--workers", "2", "--out", out], tmp_path)
    logs = Path(os.environ["BEATFLOW_LOG_DIR"])
    marker = {"load": "partitions, fs", "training": "train-vae"}[when]

    def there():
        mine = [q for q in logs.glob(f"*-{p.pid}-run.log")]
        return bool(mine) and marker in mine[0].read_text(errors="replace")

    _wait_for(there, p)
    started = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    assert len(started) >= 3  # (the API server, two workers, figure processes)
    t0 = time.time()
    os.killpg(p.pid, sig)  # the whole process group, as a terminal does
    stdout, stderr = p.communicate(timeout=30)
    took = time.time() - t0
    assert p.returncode == code and took < 5.0, (took, stderr)
    assert stderr == "beatflow: interrupted\n" and stdout == ""
    time.sleep(0.3)
    assert _descendants_alive(started) == [] and [q.pid for q in _session_processes(p.pid)] == []
    assert sorted(q.name for q in tmp_path.iterdir()) == []  # no --out, no .partial folder


def test_the_second_ctrl_c_stops_at_once(tmp_path):
    p = _start(["run", "--hours", "0.2", "--workers", "2", "--out", tmp_path / "out"], tmp_path)
    logs = Path(os.environ["BEATFLOW_LOG_DIR"])
    _wait_for(lambda: any("partitions, fs" in q.read_text(errors="replace")
                          for q in logs.glob(f"*-{p.pid}-run.log")), p)
    os.killpg(p.pid, signal.SIGINT)
    os.killpg(p.pid, signal.SIGINT)
    stdout, stderr = p.communicate(timeout=30)
    assert p.returncode == 130 and stderr == "beatflow: interrupted\n"
    assert sorted(q.name for q in tmp_path.iterdir()) == []


from test_score_new import trained_store  # noqa: E402,F401  (fixture)


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_an_interrupted_score_puts_its_item_back_in_the_inbox(tmp_path, trained_store, sig, code):  # noqa: F811
    from beatflow.io.synth import synthesize_ecg

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    x = synthesize_ecg(hours=1.0, fs=250.0, seed=4).signal
    (inbox / "long.csv").write_text("heartbeats\n" + "\n".join(f"{v:.4f}" for v in x) + "\n")
    before = (inbox / "long.csv").read_bytes()
    p = _start(["score", "--inbox", inbox, "--store", trained_store], tmp_path)
    _wait_for(lambda: any((inbox / "processing").glob("*/long.csv")), p)
    started = [c.pid for c in psutil.Process(p.pid).children(recursive=True)]
    t0 = time.time()
    os.killpg(p.pid, sig)
    stdout, stderr = p.communicate(timeout=30)
    assert p.returncode == code and time.time() - t0 < 5.0, stderr
    assert stderr == "beatflow: interrupted\n" and stdout == ""
    assert (inbox / "long.csv").read_bytes() == before  # back where it was, whole
    assert not list((inbox / "processing").iterdir()) and not (inbox / "done").exists()
    time.sleep(0.3)
    assert _descendants_alive(started) == [] and [q.pid for q in _session_processes(p.pid)] == []


def _evil_store(tmp_path, trained_store, kind):  # noqa: F811
    """A store whose latest model is tampered with (its hash no longer matches) or matches its hash
    but holds a pickle that would run code."""
    import json
    import shutil

    import torch

    from beatflow.io.store import Store

    root = tmp_path / "store"
    shutil.copytree(trained_store, root)
    st = Store(root)
    if kind == "tampered":
        path, _ = st.latest_model()
        path.write_bytes(path.read_bytes()[:-10] + b"0123456789")
        return root, None
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    evil = tmp_path / "evil.pt"
    torch.save({"width": 64, "state_dict": Payload()}, evil)
    meta = json.loads(next(st.models.glob("*/model.json")).read_text())
    st.register_model(evil, meta)
    return root, marker


@pytest.mark.parametrize("kind,message", [
    ("tampered", "sha256 does not match the registry; not loaded"),
    ("pickle", "the registered model does not load (torch.load(weights_only=True) refused it"),
])
def test_score_with_a_bad_model_is_one_line(prefect_server, trained_store, tmp_path, kind, message):  # noqa: F811
    from conftest import run_cli

    store, marker = _evil_store(tmp_path, trained_store, kind)
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    (inbox / "a.csv").write_text("heartbeats\n" + "0.1\n" * 100)
    r = run_cli(["score", "--inbox", inbox, "--store", store], prefect_server, timeout=300)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("beatflow: error: ") and message in r.stderr, r.stderr
    assert sorted(p.name for p in inbox.iterdir()) == ["a.csv"]  # the inbox as it was
    assert marker is None or not marker.exists()  # (the pickle's code never ran)


def test_score_exits_1_with_a_count_when_items_failed(prefect_server, trained_store, tmp_path):  # noqa: F811
    from beatflow.io.synth import synthesize_ecg
    from conftest import run_cli

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    x = synthesize_ecg(hours=0.05, fs=250.0, seed=2).signal
    (inbox / "good.csv").write_text("heartbeats\n" + "\n".join(f"{v:.5f}" for v in x) + "\n")
    (inbox / "bad.csv").write_text("heartbeats\n0.1\noops\n")
    r = run_cli(["score", "--inbox", inbox, "--store", trained_store], prefect_server, timeout=300)
    assert r.returncode == 1
    lines = r.stdout.splitlines()
    assert len(lines) == 2 and any(ln.startswith("failed") and "bad.csv" in ln for ln in lines) \
        and any(ln.startswith("done") and "good.csv" in ln for ln in lines), r.stdout
    assert r.stderr.count("\n") == 1 and "beatflow: 1 of 2 recording(s) failed (reasons in" in r.stderr, r.stderr
