"""The Prefect UI shows a finished beatflow run with its summary artifact (headless Chromium)."""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, _free_port, run_cli

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs Debian's chromium and chromium-driver")


@pytest.fixture(scope="module")
def ui_server(tmp_path_factory):
    """`prefect server start` with its UI, on 127.0.0.1 and a free port, with its own database."""
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(tmp_path_factory.mktemp("prefect-home")), "PREFECT_UI_API_URL": api,
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.Popen([str(Path(sys.executable).with_name("prefect")), "server", "start", "--host", "127.0.0.1",
                             "--port", str(port)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 180
    while time.time() < deadline:
        try:
            if httpx.get(f"{api}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    else:
        proc.kill()
        pytest.fail("prefect server did not start")
    yield api
    proc.terminate()
    proc.wait(30)


def test_flow_run_page_shows_summary_artifact(ui_server, tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as EC
    from selenium.webdriver.support.ui import WebDriverWait

    r = run_cli(["run", "--hours", "0.1", "--epochs", "1", "--device", "cpu", "--workers", "2", "--out",
                 tmp_path / "run"], ui_server)
    assert r.returncode == 0, r.stderr[-2000:]
    runs = httpx.post(f"{ui_server}/flow_runs/filter", json={"sort": "START_TIME_DESC", "limit": 5}).json()
    run = next(fr for fr in runs if fr["state_type"] == "COMPLETED")
    base = ui_server.rsplit("/api", 1)[0]

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--window-size=1400,1100",
                 f"--user-data-dir={tmp_path / 'chrome'}"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        driver.get(f"{base}/runs/flow-run/{run['id']}")
        wait = WebDriverWait(driver, 60)
        tab = "//*[normalize-space(text())='Artifacts' or normalize-space(.)='Artifacts'][not(self::html)]"
        wait.until(lambda d: [e for e in d.find_elements(By.XPATH, tab) if e.is_displayed()])
        target = [e for e in driver.find_elements(By.XPATH, tab) if e.is_displayed()][-1]
        driver.execute_script("arguments[0].click();", target)
        wait.until(lambda d: "beatflow-summary" in d.page_source)
        time.sleep(1)
    finally:
        driver.save_screenshot(str(tmp_path / "flow-run-artifacts.png"))
        shutil.copy(tmp_path / "flow-run-artifacts.png", "/tmp/ui_fail.png")
        driver.quit()
    assert (tmp_path / "flow-run-artifacts.png").stat().st_size > 10_000
    out = ROOT / "runs" / "ui-test"
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(tmp_path / "flow-run-artifacts.png", out / "flow-run-artifacts.png")
