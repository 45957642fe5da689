"""The console (`/ui`) in headless Chromium against a real `e31 up` stack: a tenant signs in
and sees its failed job in red with its reason and its succeeded one, watches a running job's
log lines arrive, sees an array's grid, and cancels a job from its page; a second tenant sees
none of the first's jobs and gets the same 404 page for one of its job's URLs as for a random
one; an admin sees both tenants' usage.

Screenshots of each page are saved under the test's tmp dir (their paths printed); with
E31_SCREENSHOTS_DIR set, the ones docs/console.md shows are copied there too
(`E31_SCREENSHOTS_DIR=docs/img` refreshes them). Skips where Chromium, chromedriver or
selenium is missing (CI installs Debian's `chromium` and `chromium-driver`, .ci/run).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.conftest import wait_for
from tests.docblocks import doc, run_command

from .conftest import Stack
from .test_flower_browser import BROWSERS

WAIT_S = 90
DRIVERS = ("chromedriver", "chromium-driver")
DESKTOP = (1280, 800)
PHONE = (390, 844)
# the screenshots docs/console.md shows
DOCS_SHOTS = {"console-jobs.png", "console-jobs-phone.png", "console-job-running.png",
              "console-array.png", "console-gpus.png", "console-job-gpu.png"}
SCROLL_TO = "document.getElementById('%s').scrollIntoView({block: 'center'})"
GPU_LOG = "for i in $(seq 1 120); do echo gpu-line-$i; sleep 0.25; done"
SLOW_LOG = "for i in $(seq 1 240); do echo console-line-$i; sleep 0.25; done"


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    """Headless Chromium driven by chromedriver (selenium), at 1280x800."""
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed "
                                    "(pip install -e '.[dev]'): the console is not checked in "
                                    "a browser here")
    chromium = next((p for name in BROWSERS if (p := shutil.which(name))), None)
    driver_path = next((p for name in DRIVERS if (p := shutil.which(name))), None)
    if chromium is None or driver_path is None:
        pytest.skip("Chromium or chromedriver is not installed (Debian: apt-get install "
                    "chromium chromium-driver, as .ci/run does): the console is not checked "
                    "in a browser here")
    from selenium.webdriver.chrome.service import Service
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--no-first-run", "--disable-background-networking", "--disable-sync",
                 f"--user-data-dir={tmp_path / 'ud'}", "--window-size={},{}".format(*DESKTOP)):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(WAIT_S)
    try:
        yield driver
    finally:
        driver.quit()


class Console:
    """The browser on the stack's console, with the few moves the test makes."""

    def __init__(self, driver: Any, base: str, shots: Path) -> None:
        self.driver, self.base, self.shots = driver, base, shots

    def open(self, path: str) -> str:
        self.driver.get(f"{self.base}{path}")
        return str(self.driver.page_source)

    def text(self, css: str) -> str:
        from selenium.webdriver.common.by import By
        return str(self.driver.find_element(By.CSS_SELECTOR, css).text)

    def click(self, css: str) -> None:
        from selenium.webdriver.common.by import By
        self.driver.find_element(By.CSS_SELECTOR, css).click()

    def sign_in(self, token: str) -> None:
        from selenium.webdriver.common.by import By
        self.open("/ui/login")
        self.driver.find_element(By.ID, "token").send_keys(token)
        self.click("#sign-in")
        self.until(lambda: self.driver.current_url.endswith("/ui/jobs"), "the jobs page")
        assert token not in self.driver.current_url and token not in self.driver.page_source

    def sign_out(self) -> None:
        self.click(".who button")
        self.until(lambda: self.driver.current_url.endswith("/ui/login"), "the login form")

    def until(self, condition: Callable[[], Any], what: str) -> Any:
        return wait_for(condition, timeout_s=WAIT_S, poll_s=0.2, what=what)

    def shot(self, name: str, size: tuple[int, int] = DESKTOP) -> None:
        self.driver.set_window_size(*size)
        path = self.shots / name
        self.driver.save_screenshot(str(path))
        self.driver.set_window_size(*DESKTOP)
        assert path.stat().st_size > 5_000
        print(f"screenshot: {path}")
        if (keep := os.environ.get("E31_SCREENSHOTS_DIR")) and name in DOCS_SHOTS:
            shutil.copy(path, Path(keep) / name)


def tenant(stack: Stack, name: str) -> str:
    created = stack.e31("tenant", "create", name, "--json")
    assert created.returncode == 0, created.stderr
    return str(json.loads(created.stdout)["token"])


def final(handle: Any) -> Callable[[], bool]:
    return lambda: handle.status()["state"] in ("succeeded", "failed", "cancelled")


def test_the_console_shows_a_tenant_its_jobs_live_and_no_one_elses(
        stack: Stack, browser: Any, tmp_path: Path) -> None:
    ui = Console(browser, stack.url, tmp_path)
    token_a, token_b = tenant(stack, "console-a"), tenant(stack, "console-b")
    a, b = stack.client(token_a), stack.client(token_b)

    # Given tenant A's failed, succeeded, array and running jobs, and one job of tenant B
    failed = a.submit(command=["sh", "-c", "echo about to fail; exit 3"], name="breaks",
                      resources={"gpus": 0}, retries={"max": 0})
    ok = a.submit(command=["true"], name="works", resources={"gpus": 0})
    grid = a.submit_many([{"command": ["true"]}, {"command": ["true"]},
                          {"command": ["sh", "-c", "exit 1"]}], name="grid",
                         resources={"gpus": 0}, retries={"max": 0})
    theirs = b.submit(command=["true"], name="b-only", resources={"gpus": 0})
    # (and a job on a simulated GPU whose log moves, so its GPU reads busy: its chart)
    on_gpu = a.submit(command=["sh", "-c", GPU_LOG], name="on-a-gpu",
                      resources={"gpus": 1, "gpu_mem_gb": 20})
    for handle in (failed, ok, grid, theirs):
        wait_for(final(handle), timeout_s=WAIT_S, what="a job or array to end")
    running = a.submit(command=["sh", "-c", SLOW_LOG], name="talks", resources={"gpus": 0})
    wait_for(lambda: running.status()["state"] == "running", timeout_s=WAIT_S,
             what="the talking job to run")

    # When A signs in, its jobs page shows the failed job in red with its reason, and the
    # succeeded one
    ui.sign_in(token_a)
    page = ui.open("/ui/jobs")
    assert "console-a" in ui.text("#tenant")
    row = ui.text(f'tr[data-job="{failed.id}"]')
    assert "failed" in row and "exit" in row.lower()
    assert browser.find_element("css selector", f'tr[data-job="{failed.id}"]'
                                ).get_attribute("class") == "state-failed"
    assert "succeeded" in ui.text(f'tr[data-job="{ok.id}"]') and theirs.id not in page
    ui.shot("console-jobs.png")
    ui.shot("console-jobs-phone.png", PHONE)
    ui.open(f"/ui/jobs/{failed.id}")
    assert "failed" in ui.text("#job-state")
    ui.until(lambda: "about to fail" in ui.text("#log"), "the failed job's log")
    ui.shot("console-job-failed.png")

    # And the running job's page shows its log lines arriving
    ui.open(f"/ui/jobs/{running.id}")
    first = ui.until(lambda: ui.text("#log").count("console-line-") or None, "a log line")
    ui.until(lambda: ui.text("#log").count("console-line-") > first + 2, "more log lines")
    browser.execute_script(SCROLL_TO % "log")
    ui.shot("console-job-running.png")

    # And the GPU job's page draws its GPUs' utilisation and memory over its run
    def charted() -> bool:
        ui.open(f"/ui/jobs/{on_gpu.id}")
        return bool(browser.find_elements("css selector", "#gpu-chart polyline.mem"))
    ui.until(charted, "the GPU job's chart (two readings, STEP_S apart)")
    browser.execute_script(SCROLL_TO % "gpu-chart")
    ui.shot("console-job-gpu.png")

    # And the array's page shows its grid, one cell per item coloured by state
    ui.open(f"/ui/arrays/{grid.id}")
    cells = browser.find_elements("css selector", "#grid .cell")
    assert [c.get_attribute("class") for c in cells].count("cell state-succeeded") == 2
    assert [c.get_attribute("class") for c in cells].count("cell state-failed") == 1
    assert browser.find_elements("css selector", "#retry")
    ui.shot("console-array.png")

    # And cancelling the running job from its page cancels it
    ui.open(f"/ui/jobs/{running.id}")
    ui.click("#cancel")
    wait_for(lambda: running.status()["state"] == "cancelled", timeout_s=WAIT_S,
             what="the job cancelled from its page")
    ui.open(f"/ui/jobs/{running.id}")
    assert "cancelled" in ui.text("#job-state")
    for name, path in (("console-queue.png", "/ui/queue"), ("console-usage.png", "/ui/usage")):
        ui.open(path)
        ui.shot(name)
    ui.sign_out()

    # Then tenant B sees none of A's jobs, and A's job's URL is the same 404 page as a random one
    ui.sign_in(token_b)
    page = ui.open("/ui/jobs")
    assert theirs.id in page
    assert not any(j.id in page for j in (failed, ok, running))
    foreign = ui.open(f"/ui/jobs/{failed.id}")
    ui.shot("console-404.png")
    random = ui.open("/ui/jobs/j-0123456789abcdef0123456789")
    assert "404" in ui.text("h1") and foreign == random
    ui.sign_out()

    # And the admin sees both tenants' usage and every GPU
    ui.sign_in(stack.token)
    ui.open("/ui/usage")
    usage = ui.text("#usage")
    assert "console-a" in usage and "console-b" in usage
    ui.open("/ui/gpus")
    assert browser.find_elements("css selector", "#gpus tbody tr")
    ui.shot("console-gpus.png")


def test_the_docs_curl_sign_in_answers_303_and_then_the_jobs_page(stack: Stack,
                                                                  tmp_path: Path) -> None:
    """docs/console.md's `curl` block, on the test stack's address; its home from E31_HOME,
    as the block reads it (issue 32: it read ~/.e31 whatever E31_HOME said)."""
    block = doc("docs/console.md").run_blocks("curl")[0]
    script = block.text.replace("127.0.0.1:8031", urlsplit(stack.url).netloc)
    ran = run_command(script, env=stack.env, cwd=tmp_path)
    assert ran.returncode == 0, ran.output
    assert ran.output.split() == ["303", "<title>Jobs", "·", "E31", "console</title>"]
