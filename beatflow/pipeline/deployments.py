"""Deployment entry points: flows that choose their task runner from their parameters.

A deployment runs the flow function directly, so the Dask task runner (CPU LocalCluster or
GPU LocalCUDACluster) is chosen here, from the parameters a user sets in the Prefect UI: the cluster of
``beatflow serve`` (:mod:`beatflow.pipeline.service`) when it runs on the device asked for, else one of
the run's own.
"""
from __future__ import annotations

import os
from pathlib import Path

from prefect import flow

from beatflow.device import resolve_device
from beatflow.pipeline.cluster import make_task_runner
from beatflow.pipeline.flow import ecg_anomaly_flow


@flow(name="train-and-score", log_prints=True)
def train_and_score(input: str | None = None, device: str = "auto", workers: int = 2, hours: float = 20.0,
                    seed: int = 0, out: str | None = None, epochs: int = 10, store: str | None = ".beatflow",
                    lead: int | str = 0, column: str | None = None, confirm_lead: int | str | None = None,
                    confirm_column: str | None = None) -> dict:
    """Run the full pipeline (segment, embed, train, build the engine, score, report); ``lead`` /
    ``column`` choose the input's lead, ``confirm_lead`` / ``confirm_column`` a second one that checks
    the beats (``beatflow run --confirm-lead``)."""
    from prefect.settings import get_current_settings

    from beatflow.pipeline.service import find_service, service_disabled

    service = None if service_disabled() else find_service()
    api = (get_current_settings().api.url or "").rstrip("/")
    if service is not None and (device not in ("auto", service["device"]) or api != service["api_url"].rstrip("/")):
        service = None  # (a device the service does not run, or its workers talk to another API: own cluster)
    dev = service["device"] if service is not None else resolve_device(device)
    runner = make_task_runner(dev, workers, scheduler=service["scheduler"] if service is not None else None)
    return ecg_anomaly_flow.with_options(task_runner=runner)(
        input=input, hours=hours, seed=seed, out=out, device=dev, workers=workers, epochs=epochs, store=store,
        lead=lead, column=column, confirm_lead=confirm_lead, confirm_column=confirm_column,
        service=service is not None)


def bench_script(name: str = "pipeline_bench.py") -> Path:
    """``bench/<name>`` of the checkout the deployment runs from (bench/ is not installed): the folder
    ``prefect.yaml``'s pull step sets (``$BEATFLOW_HOME``), the working directory, or the checkout
    that holds this module (an editable install, or ``PYTHONPATH``).

    Raises
    ------
    FileNotFoundError
        None of them has it.
    """
    here = Path(__file__).resolve().parents[2]
    tried = [Path(p) for p in (os.environ.get("BEATFLOW_HOME"), os.getcwd()) if p] + [here]
    for root in tried:
        script = root / "bench" / name
        if script.is_file():
            return script.resolve()
    raise FileNotFoundError(f"bench/{name} not found in {', '.join(str(r) for r in tried)} (a checkout of "
                            "beatflow; set BEATFLOW_HOME to it)")


@flow(name="benchmark", log_prints=True)
def benchmark(hours: float = 20.0) -> str:
    """Run bench/pipeline_bench.py and keep its table as a markdown artifact."""
    import subprocess
    import sys

    from prefect.artifacts import create_markdown_artifact

    script = bench_script()
    r = subprocess.run([sys.executable, str(script), "--hours", str(hours)], capture_output=True, text=True,
                       cwd=script.parents[1], check=True)
    create_markdown_artifact(r.stdout, key="beatflow-benchmark", description="pipeline benchmark")
    return r.stdout
