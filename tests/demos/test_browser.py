"""The Gradio demo in headless Chromium (selenium + Debian's chromium and chromedriver).

Drives the demo the quick start started: sends a prompt to a FedDPA client, waits for the answer and
the per-answer weight, opens the evaluation tab, and saves screenshots under ``artifacts/``. Chromium
is installed by ``make browser`` (CI runs it first) or, when missing, by this test's setup (as root
with apt). Outside CI the test is skipped when that is impossible; in CI (``CI=true``) it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.demos.conftest import REPO, Stack

ARTIFACTS = REPO / "artifacts"
APT = ("apt-get install -y --no-install-recommends chromium chromium-driver || "
       "(apt-get update && apt-get install -y --no-install-recommends chromium chromium-driver)")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
    """Skip outside CI; fail loudly in CI, where the browser test must run."""
    if in_ci():
        pytest.fail(f"CI must run the browser test, but {reason}")
    pytest.skip(reason)


def chromium() -> tuple[str, str] | None:
    browser = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    return (browser, driver) if browser and driver else None


def ensure_chromium() -> tuple[str, str]:
    """(browser, chromedriver), installing Debian's packages first when they are missing and we are root."""
    found = chromium()
    if found is None and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["bash", "-c", APT], env=env, capture_output=True, timeout=900, check=False)
        found = chromium()
    if found is None:
        unavailable("headless Chromium is not installed and could not be installed here "
                    "(run `make browser`, or apt-get install chromium chromium-driver)")
    assert found is not None
    return found


@pytest.fixture(scope="module")
def driver() -> Iterator[Any]:
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        unavailable("selenium is not installed (it is in the dev extra: pip install -e '.[dev]')")
    browser, chromedriver = ensure_chromium()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1400,1500", "--disable-extensions"):
        options.add_argument(arg)
    session = webdriver.Chrome(service=Service(chromedriver), options=options)
    try:
        yield session
    finally:
        session.quit()


def test_prompt_gets_an_answer_and_a_feddpa_weight(stack: Stack, driver: Any,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    def text(element_id: str) -> str:
        return str(driver.find_element(By.ID, element_id).text)

    driver.get(stack.demo)
    wait = WebDriverWait(driver, 120, poll_frequency=0.5)
    wait.until(lambda _: "Connected to" in text("status"))
    assert "8 FedDPA clients" in text("status")  # the demo reached the API with its key
    target = driver.find_element(By.CSS_SELECTOR, "#target input")
    target.click()
    target.send_keys(Keys.CONTROL, "a")
    target.send_keys("sorting")  # the dropdown filters its options as one types
    option = wait.until(lambda _: next((o for o in driver.find_elements(By.CSS_SELECTOR, "[role=listbox] [role=option]")
                                        if o.text.startswith("sorting — client")), None))
    option.click()
    wait.until(lambda _: target.get_attribute("value").startswith("sorting — client"))
    # the tiny random model answers greedy prompts with newlines only: sample, so the answer shows text
    temperature = driver.find_element(By.CSS_SELECTOR, "#temperature input[type=number]")
    temperature.send_keys(Keys.CONTROL, "a")
    temperature.send_keys("1", Keys.TAB)
    wait.until(lambda _: driver.find_element(By.CSS_SELECTOR, "#temperature input[type=range]")
               .get_attribute("value") == "1")
    driver.find_element(By.CSS_SELECTOR, "#prompt textarea").send_keys("Sort these words: pear apple fig")
    driver.find_element(By.ID, "send").click()
    wait.until(lambda _: "FedDPA weight a = " in text("route"))
    route = text("route")
    # the quick-start run is calibrated at the end of training, and calibrated is the default weighting
    assert "sorting" in route and "instance-wise, calibrated" in route and "background level" in route
    bubbles = [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#chat [data-testid=bot]")]
    assert len(bubbles) == 2 and bubbles[0].strip() and "(empty answer" not in bubbles[0], bubbles  # answer, note
    assert "FedDPA a = " in bubbles[1]
    assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#chat [data-testid=user]")] == [
        "Sort these words: pear apple fig"]
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "demo.png"
    assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

    tab = next(b for b in driver.find_elements(By.CSS_SELECTOR, "button[role=tab]") if b.text.strip() == "Evaluation")
    tab.click()
    wait.until(lambda _: "Test-Time Personalization" in text("eval-tables"))
    assert driver.find_elements(By.CSS_SELECTOR, "#eval-plots img")
    driver.save_screenshot(str(ARTIFACTS / "demo-evaluation.png"))
    with capsys.disabled():
        print(f"\n[browser test] demo screenshot: {shot}  (evaluation tab: {ARTIFACTS / 'demo-evaluation.png'})")
