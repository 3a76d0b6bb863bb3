"""prefect.yaml for real: deploy to a process work pool on a real server, start a worker, trigger
`score-new-recordings` through the API, and see the run complete and the results appear."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from beatflow.io.store import Store
from conftest import ROOT
from test_score_new import trained_store  # noqa: F401  (fixture)

PREFECT = str(Path(sys.executable).with_name("prefect"))


def test_deploy_worker_and_scheduled_scoring(prefect_server, trained_store, tmp_path):  # noqa: F811
    from beatflow.io.synth import synthesize_ecg

    env = {**os.environ, "PREFECT_API_URL": prefect_server, "BEATFLOW_HOME": str(ROOT),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    run = lambda *a: subprocess.run([PREFECT, *a], env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)  # noqa: E731
    r = run("work-pool", "create", "beatflow", "--type", "process", "--overwrite")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run("--no-prompt", "deploy", "--all")
    assert r.returncode == 0, r.stdout + r.stderr
    for name in ("train-and-score", "score-new-recordings", "benchmark"):
        assert name in r.stdout

    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        dep = client.read_deployment_by_name("score-new-recordings/score-new-recordings")
        assert dep.schedules and dep.schedules[0].schedule.cron == "0 2 * * *"
        # one run at a time; a run started during another one waits for it (not cancelled)
        assert dep.global_concurrency_limit is not None and dep.global_concurrency_limit.limit == 1
        assert dep.concurrency_options is not None and dep.concurrency_options.collision_strategy == "ENQUEUE"
        for name in ("score-new-recordings/score-new-recordings", "train-and-score/train-and-score"):
            props = client.read_deployment_by_name(name).parameter_openapi_schema["properties"]
            assert {"lead", "column", "confirm_lead", "confirm_column"} <= set(props)  # (settable in the UI)

    inbox = tmp_path / "inbox"
    inbox.mkdir()
    x = synthesize_ecg(hours=0.03, fs=250.0, seed=4).signal
    (inbox / "night.csv").write_text("heartbeats\n" + "\n".join(f"{v:.5f}" for v in x) + "\n")

    worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "beatflow", "--limit", "1"], env=env, cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        from prefect.deployments import run_deployment

        flow_run = run_deployment("score-new-recordings/score-new-recordings", timeout=400,
                                  parameters={"inbox": str(inbox), "store": str(trained_store)})
        assert flow_run.state.is_completed(), flow_run.state
    finally:
        worker.terminate()
        try:
            out, _ = worker.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            worker.kill()
    assert (inbox / "done" / "night.csv").exists() and not any((inbox / "processing").iterdir())
    df = Store(trained_store).read_results()
    assert "night" in set(df["recording"].astype(str))


def test_prefect_yaml_entrypoints_load():
    """Every entry point of prefect.yaml loads from the checkout (as ``prefect deploy`` and a worker load
    them) and is the flow of beatflow.pipeline it names; the entry points' packages re-export the flows and
    tasks."""
    import yaml
    from prefect.flows import load_flow_from_entrypoint

    import flows.pipeline
    import tasks
    from beatflow.pipeline import deployments, flow, inbox_flow, stages

    spec = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    want = {"train-and-score": deployments.train_and_score, "score-new-recordings": inbox_flow.score_new_recordings,
            "benchmark": deployments.benchmark}
    got = {}
    for d in spec["deployments"]:
        path, _, name = d["entrypoint"].partition(":")
        assert (ROOT / path).is_file(), d["entrypoint"]
        got[d["name"]] = load_flow_from_entrypoint(str(ROOT / path) + ":" + name)
    assert set(got) == set(want)
    for name, f in got.items():
        assert f.name == want[name].name and f.fn.__module__ == want[name].fn.__module__, name
    assert flows.pipeline.ecg_anomaly_flow is flow.ecg_anomaly_flow
    assert all(getattr(tasks, n) is getattr(stages, n, None) or n == "score_inbox_item" for n in tasks.__all__)


def test_the_benchmark_finds_its_script_in_the_checkout(tmp_path, monkeypatch):
    """The benchmark deployment runs bench/pipeline_bench.py of the checkout (not installed): the one under
    ``$BEATFLOW_HOME`` (prefect.yaml's working directory), else the working directory's, else the one beside
    the package; none is one clear error."""
    from beatflow.pipeline.deployments import bench_script

    monkeypatch.delenv("BEATFLOW_HOME", raising=False)
    monkeypatch.chdir(tmp_path)
    assert bench_script() == ROOT / "bench" / "pipeline_bench.py"  # (beside the package: this checkout)
    other = tmp_path / "home"
    (other / "bench").mkdir(parents=True)
    (other / "bench" / "pipeline_bench.py").write_text("print('x')\n")
    monkeypatch.chdir(other)
    assert bench_script() == other / "bench" / "pipeline_bench.py"
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BEATFLOW_HOME", str(other))
    assert bench_script() == other / "bench" / "pipeline_bench.py"
    with pytest.raises(FileNotFoundError, match="BEATFLOW_HOME"):
        bench_script("missing.py")
