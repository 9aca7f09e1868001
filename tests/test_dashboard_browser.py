"""The dashboard in a real browser: Debian's headless Chromium driven by Selenium.

Launch a run from the form and watch it finish live, compare two runs, stop
a running run, and see an invalid value's message. Each test saves a
screenshot of its page (``FEDACCEL_DASHBOARD_SCREENSHOTS=docs/images`` makes
the ones in docs/dashboard.md).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from dashboard_helpers import POST, live_server, record_run, run_state, wait_for

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")
if not (CHROMIUM and CHROMEDRIVER):
    pytest.skip("needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver; "
                "scripts/install.sh does it as root)", allow_module_level=True)

from selenium import webdriver  # noqa: E402
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.support.ui import Select  # noqa: E402
from selenium.common.exceptions import StaleElementReferenceException  # noqa: E402


@pytest.fixture(scope="module")
def browser():
    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        options.add_argument(arg)
    options.binary_location = CHROMIUM
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    yield driver
    driver.quit()


@pytest.fixture
def shots(tmp_path):
    folder = Path(os.environ.get("FEDACCEL_DASHBOARD_SCREENSHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)

    def shoot(driver, name: str, top: bool = True) -> None:
        if top:
            driver.execute_script("window.scrollTo(0, 0)")
        driver.save_screenshot(str(folder / f"dashboard-{name}.png"))

    return shoot


def text(driver, element_id: str) -> str:
    found = driver.find_elements(By.ID, element_id)
    return found[0].text if found else ""


def pick_every_run(driver) -> bool:
    """Tick every run's box; True once all are ticked. The runs table is
    redrawn while it polls (keeping the ticks), so a box found before a
    redraw is stale after it: found again on the next try."""
    try:
        for box in driver.find_elements(By.CSS_SELECTOR, "input.pick"):
            if not box.is_selected():
                box.click()
        boxes = driver.find_elements(By.CSS_SELECTOR, "input.pick")
        return bool(boxes) and all(box.is_selected() for box in boxes)
    except StaleElementReferenceException:
        return False


def set_field(driver, key: str, value: str) -> None:
    field = driver.find_element(By.ID, f"field-{key}")
    field.clear()
    field.send_keys(value)


def no_reload_marker(driver) -> None:
    driver.execute_script("window.__sameDocument = true;")


def same_document(driver) -> bool:
    return driver.execute_script("return window.__sameDocument === true;")


def test_launch_from_the_form_and_watch_it_finish_live(browser, tmp_path, shots):
    results = tmp_path / "results"
    with live_server([results]) as base:
        browser.get(f"{base}/#/launch")
        wait_for(lambda: browser.find_elements(By.ID, "field-algo"), 30, "the form")
        Select(browser.find_element(By.ID, "field-algo")).select_by_value("fedprox")
        assert browser.find_element(By.ID, "field-fedprox.mu").is_displayed()
        assert not browser.find_element(By.ID, "field-fedacg.beta").is_displayed()  # another algorithm's
        set_field(browser, "num-server-rounds", "3")
        set_field(browser, "fedprox.mu", "0.2")
        set_field(browser, "run-name", "from-the-form")
        shots(browser, "launch")
        no_reload_marker(browser)
        browser.find_element(By.ID, "launch-button").click()
        wait_for(lambda: "#/run/0%2Ffrom-the-form" in browser.current_url, 30, "the run's page")
        seen_rounds = set()

        def finished():
            seen_rounds.add(text(browser, "run-round"))
            return text(browser, "run-state") == "finished"

        wait_for(finished, 120, "the run to finish on the page", interval=0.05)
        assert same_document(browser)  # live: the page was never reloaded
        assert text(browser, "run-round").startswith("round 3 / 3")
        assert len(seen_rounds) >= 2  # it showed progress on the way
        points = browser.execute_script("return document.getElementById('plot-accuracy').data[0].x.length")
        assert points == 3
        assert "[fedaccel] round 3/3" in text(browser, "run-log")
        shots(browser, "run")
        # "run again with" prefills the form with this run's settings
        browser.find_element(By.ID, "again-button").click()
        wait_for(lambda: browser.find_elements(By.ID, "field-fedprox.mu"), 30, "the prefilled form")
        assert browser.find_element(By.ID, "field-fedprox.mu").get_attribute("value") == "0.2"
        assert Select(browser.find_element(By.ID, "field-algo")).first_selected_option.text == "fedprox"
        assert browser.find_element(By.ID, "field-run-name").get_attribute("value") == ""


def test_compare_two_runs(browser, tmp_path, shots):
    results = tmp_path / "results"
    record_run(results, "fedavg-run", 4, [0.40, 0.55, 0.60, 0.62])
    record_run(results, "fedprox-run", 4, [0.42, 0.58, 0.66, 0.70], algo="fedprox")
    with live_server([results]) as base:
        browser.get(f"{base}/#/")
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#runs-table tbody tr")) == 2, 30, "the runs")
        wait_for(lambda: "SuperLink connection" in text(browser, "flower"), 60, "the Flower runs' panel")
        shots(browser, "runs")
        wait_for(lambda: pick_every_run(browser), 30, "both runs picked")
        browser.find_element(By.ID, "compare-button").click()
        wait_for(lambda: browser.find_elements(By.ID, "compare-table"), 30, "the comparison")
        rows = sorted(r.text for r in browser.find_elements(By.CSS_SELECTOR, "#compare-table tbody tr"))
        assert rows == ["fedavg-run fedavg 62.00 62.00 54.25 2 0.02",
                        "fedprox-run fedprox 70.00 70.00 59.00 2 0.02"]
        traces = browser.execute_script("return document.getElementById('compare-rounds').data.length")
        assert traces == 2
        shots(browser, "compare")


def test_stop_a_running_run(browser, tmp_path, shots):
    results = tmp_path / "results"
    with live_server([results]) as base:
        body = {"values": {"num-server-rounds": "500", "run-name": "long"}, "num_clients": 10}
        httpx.post(f"{base}/api/launch", json=body, headers=POST, timeout=30).raise_for_status()
        browser.get(f"{base}/#/run/0%2Flong")
        wait_for(lambda: text(browser, "run-state") == "running", 120, "the run to be running")
        wait_for(lambda: browser.find_element(By.ID, "stop-button").is_enabled(), 30, "the stop button")
        browser.find_element(By.ID, "stop-button").click()
        wait_for(lambda: text(browser, "run-message"), 30, "the stop request's answer")
        assert "SIGINT" in text(browser, "run-message"), text(browser, "run-message")
        try:
            wait_for(lambda: text(browser, "run-state") == "stopped", 60, "the page to show it stopped")
        except AssertionError as err:  # say what the run did
            status = (results / "long" / "status.json").read_text()
            console = (results / "long" / "console.log").read_text()[-2000:]
            raise AssertionError(f"{err}\nstatus.json: {status}\nconsole.log: {console}") from None
        assert not browser.find_element(By.ID, "stop-button").is_enabled()
        assert run_state(base, "0/long")["state"] == "stopped"
        shots(browser, "stopped")


def test_an_invalid_value_shows_the_message_and_launches_nothing(browser, tmp_path, shots):
    results = tmp_path / "results"
    with live_server([results]) as base:
        browser.get(f"{base}/#/launch")
        wait_for(lambda: browser.find_elements(By.ID, "field-lr"), 30, "the form")
        set_field(browser, "lr", "-1")
        browser.find_element(By.ID, "launch-button").click()
        wait_for(lambda: text(browser, "form-error"), 30, "the message")
        assert text(browser, "form-error") == "invalid run config: lr=-1: must be > 0"
        assert "invalid" in browser.find_element(By.ID, "field-lr").get_attribute("class")
        beside = browser.find_element(By.CSS_SELECTOR, ".field-error").text  # next to the field too
        assert beside == "invalid run config: lr=-1: must be > 0"
        assert "#/launch" in browser.current_url
        assert not results.exists() or not any(results.iterdir())
        shots(browser, "invalid", top=False)


def test_launch_a_study_and_watch_its_table_fill(browser, tmp_path, shots):
    from test_dashboard_studies import study_file

    results = tmp_path / "results"
    path = study_file(tmp_path, rounds=3)  # 2 variants x 2 seeds, 3 rounds each
    with live_server([results]) as base:
        browser.get(f"{base}/#/launch-study")
        wait_for(lambda: browser.find_elements(By.ID, "study-file-pick"), 30, "the study form")
        Select(browser.find_element(By.ID, "study-file-pick")).select_by_value("")
        browser.find_element(By.ID, "study-file-path").send_keys(str(path))
        browser.find_element(By.ID, "study-workers").send_keys("1")
        browser.find_element(By.ID, "study-check").click()
        wait_for(lambda: "4 cells, all valid" in text(browser, "study-command"), 30, "the check")
        no_reload_marker(browser)
        browser.find_element(By.ID, "study-launch").click()
        wait_for(lambda: "#/study/0%2Fsweeps%2Ftiny" in browser.current_url, 30, "the study's page")
        seen = set()

        def finished():
            seen.add(text(browser, "study-progress"))
            return text(browser, "study-state") == "finished"

        wait_for(finished, 180, "the study to finish on its page", interval=0.05)
        assert same_document(browser)  # live: the page was never reloaded
        assert text(browser, "study-progress") == "4 of 4 cells finished"
        assert len(seen) >= 2  # it showed progress on the way
        wait_for(lambda: len(browser.find_elements(By.CSS_SELECTOR, "#study-groups-table tbody tr")) == 2, 30,
                 "the table over seeds")
        groups = [r.text.split()[0] for r in browser.find_elements(By.CSS_SELECTOR, "#study-groups-table tbody tr")]
        assert groups == ["fedavg", "fedprox"]
        cells = browser.find_elements(By.CSS_SELECTOR, "#study-cells-table tbody tr")
        assert len(cells) == 4 and all("finished" in c.text for c in cells)
        traces = browser.execute_script("return document.getElementById('study-curves').data.length")
        assert traces == 4  # a mean line and a ± std band per group
        assert not browser.find_element(By.ID, "study-stop").is_enabled()
        shots(browser, "study")
        browser.get(f"{base}/#/")
        wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#studies-table tbody tr"), 30, "the studies table")
        row = browser.find_element(By.CSS_SELECTOR, "#studies-table tbody tr").text
        assert row.startswith("tiny finished 4 / 4")
