"""`rl ui` in a real browser (issue #45): headless Chromium from Debian's packages driven by Selenium through Debian's
chromedriver (no browser download). A finished run and a live one (a writer adds metrics and samples while the page
is open): the runs table, the curves (redrawn with the live run's new points), the samples table with a filter
applied through the form, one sample's tokens coloured by log-prob, by policy version and by trained mask, with its
tool turns; an XSS payload in every field is shown as text and never runs. Screenshots go to $UI_SCREENSHOTS when
set. Missing Chromium skips locally and fails under CI=true (.ci/run installs it)."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest

from rl.ui.data import Dashboard
from rl.ui.server import UIServer
from tests.ui_run import XSS, make_run, sample

pytestmark = pytest.mark.integration

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")


@pytest.fixture(scope="module")
def browser():
    if not (CHROMIUM and DRIVER):
        why = "needs Debian's chromium and chromium-driver (apt-get install chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true but the browser tests cannot run: {why}")
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1100",
                "--disable-gpu", "--no-first-run"):
        opts.add_argument(arg)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-browser")
    finished, live = make_run(root / "finished"), make_run(root / "live", n=30, name="live-run")
    server = UIServer(Dashboard([finished, live]), port=0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server, finished, live
    server.shutdown()
    server.server_close()
    server.dashboard.close()


def _open(driver, server, hash_: str, ready: str):
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(f"http://127.0.0.1:{server.server_address[1]}/?token={server.token}#{hash_}")
    WebDriverWait(driver, 20).until(lambda d: d.find_element("id", "main").get_attribute("data-ready") == ready
                                    or d.find_elements("id", "error"))
    errors = driver.find_elements("id", "error")
    assert not errors, errors[0].text
    assert driver.execute_script("return window.__xss") is None  # no payload ran


def _charts(driver) -> dict[str, dict]:
    """Each curve chart's title -> its series, point count and canvases, read in one script: the page redraws its
    charts every 5 s and replaces their elements, so an element found by one call may be stale at the next (a loaded
    machine widens that window)."""
    return driver.execute_script("""
        const out = {};
        for (const c of document.querySelectorAll('#charts .chart'))
            out[c.dataset.chart] = {series: c.dataset.series, points: Number(c.dataset.points),
                                    canvases: c.querySelectorAll('canvas').length};
        return out;""")


def _shot(driver, name: str, tmp_path):
    out = os.environ.get("UI_SCREENSHOTS") or tmp_path
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"{name}.png")
    assert driver.save_screenshot(path) and os.path.getsize(path) > 5000
    return path


def test_the_runs_table_shows_each_run_and_its_payloads_as_text(browser, served, tmp_path):
    server, _, _ = served
    _open(browser, server, "/", "/")
    rows = browser.find_elements("css selector", "#runs tbody tr")
    assert [r.get_attribute("data-run") for r in rows] == ["0", "1"]
    cells = [c.text for c in rows[0].find_elements("css selector", "td")]
    assert cells[0] == f"run {XSS}" and cells[1] == "sft -> grpo" and cells[3] == "300" and cells[4] == "0.625"
    assert not browser.find_elements("css selector", "#runs img")  # the payload's <img> was never made
    _shot(browser, "runs", tmp_path)


def test_curves_overlay_both_runs_mark_reconfigurations_and_follow_the_live_run(browser, served, tmp_path):
    server, _, live = served
    _open(browser, server, "/curves?runs=0,1", "/curves")
    charts = _charts(browser)
    assert {"reward", "entropy", "held-out", "time split (cumulative s)"} <= set(charts)
    assert charts["reward"]["canvases"]
    # the batch-wide reward and its breakdowns (per dataset, per effort level), 300 steps of each run
    assert charts["reward"]["series"] == "rollout/reward rollout/reward/arith rollout/reward/effort50"
    assert charts["reward"]["points"] == 1800
    assert charts["held-out"]["series"] == "eval/accuracy eval/arith/accuracy"
    _shot(browser, "curves", tmp_path)
    with (live / "metrics.jsonl").open("a") as f:  # the live job writes 50 more steps
        for step in range(301, 351):
            f.write(json.dumps({"step": step, "time": 2000.0 + step, "rollout/reward": 0.9}) + "\n")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # the page redraws every 5 s
        if _charts(browser)["reward"]["points"] == 1850:
            break
        time.sleep(0.5)
    assert _charts(browser)["reward"]["points"] == 1850


def test_the_samples_table_filters_through_its_form_and_pages(browser, served, tmp_path):
    server, _, live = served
    _open(browser, server, "/samples?run=0", "/samples")
    assert len(browser.find_elements("css selector", "#samples tbody tr")) == 50
    form = browser.find_element("id", "filters")
    form.find_element("name", "step").send_keys("2")
    form.find_element("name", "min_reward").send_keys("1")
    browser.find_element("id", "apply").click()
    from selenium.webdriver.support.ui import WebDriverWait

    WebDriverWait(browser, 20).until(lambda d: d.find_element("id", "main").get_attribute("data-ready") == "/samples"
                                     and "step=2" in d.current_url)
    rows = browser.find_elements("css selector", "#samples tbody tr")
    assert [r.get_attribute("data-sample") for r in rows] == ["s062", "s067", "s072", "s077", "s082", "s087", "s092", "s097"]
    assert all(r.find_elements("css selector", "td")[3].text == "1.000" for r in rows)
    _shot(browser, "samples", tmp_path)
    _open(browser, server, "/samples?run=0&offset=100", "/samples")
    assert len(browser.find_elements("css selector", "#samples tbody tr")) == 20 and browser.find_elements("id", "prev")
    gsm = [r for r in browser.find_elements("css selector", "#samples tbody tr")
           if r.find_elements("css selector", "td")[1].text == f"gsm {XSS}"]
    assert gsm  # a dataset name with markup in it, shown as its text


def test_one_sample_is_coloured_token_by_token_with_its_tool_turns_and_verdict(browser, served, tmp_path):
    server, _, _ = served
    _open(browser, server, "/sample?run=0&id=s009", "/sample")
    spans = browser.find_elements("css selector", "#tokens span.tok")
    assert len(spans) == 31 and "".join(s.text for s in spans[:5]) == "call:"
    colours = {s.value_of_css_property("background-color") for s in spans}
    assert len(colours) >= 3  # seven log-prob levels: several shades
    assert [s.get_attribute("class") for s in spans[16:21]] == ["tok", "tok masked", "tok masked", "tok masked", "tok"]
    fields = {f.get_attribute("data-field"): f.text for f in browser.find_elements("css selector", "#fields td[data-field]")}
    assert fields["verdict"] == f"expected 42 {XSS}" and fields["train step"] == "1"
    turns = browser.find_elements("css selector", "[data-turn]")
    assert [t.get_attribute("data-turn") for t in turns] == ["model", "tool", "model"] and f"42 {XSS}" in turns[1].text
    assert browser.find_element("id", "prompt").text == f"What is 6*7? {XSS}"
    _shot(browser, "sample", tmp_path)
    from selenium.webdriver.support.ui import Select

    _open(browser, server, "/sample?run=0&id=s003", "/sample")
    Select(browser.find_element("id", "color-mode")).select_by_value("version")
    spans = browser.find_elements("css selector", "#tokens span.tok")
    by_version = {}
    for s in spans:
        by_version.setdefault(s.get_attribute("data-version"), set()).add(s.value_of_css_property("background-color"))
    assert sorted(by_version) == ["1", "2"] and all(len(c) == 1 for c in by_version.values())
    assert by_version["1"] != by_version["2"]  # two segments, two colours
    _open(browser, server, "/sample?run=0&id=s061", "/sample")
    Select(browser.find_element("id", "color-mode")).select_by_value("stale")
    spans = browser.find_elements("css selector", "#tokens span.tok")
    assert [s.get_attribute("data-stale") for s in spans[:4]] == ["true", "true", "true", "false"]
    assert spans[0].value_of_css_property("background-color") != spans[3].value_of_css_property("background-color")
    assert browser.find_element("id", "stale-note").text.startswith("staleness: 3 of 9 trained tokens stale")


def test_the_timeline_charts_steps_over_time_and_lists_every_config_version(browser, served, tmp_path):
    server, _, _ = served
    _open(browser, server, "/timeline?run=0", "/timeline")
    assert browser.find_element("id", "timeline-chart").find_elements("tag name", "canvas")
    assert int(browser.find_element("id", "timeline-chart").get_attribute("data-points")) == 300
    rows = browser.find_elements("css selector", "#versions tbody tr")
    assert [r.get_attribute("data-status") for r in rows] == ["applied", "refused"]
    cells = [c.text for c in rows[1].find_elements("css selector", "td")]
    assert cells[4] == f"unknown dataset {XSS}" and XSS.replace('"', '\\"') in cells[3]  # the patch's JSON, as text
    _shot(browser, "timeline", tmp_path)


def test_a_sample_the_live_job_just_wrote_opens(browser, served, tmp_path):
    from rl.store.trajectories import TrajectoryStore

    server, _, live = served
    store = TrajectoryStore.for_run_dir(live)  # the job's writer, open while the page reads
    try:
        store.add_samples([sample(500, dataset="arith", reward=1.0, response="6*7 = 42", step_finished=500.0)])
        _open(browser, server, "/samples?run=1&sort=-seq", "/samples")
        assert browser.find_elements("css selector", "#samples tbody tr")[0].get_attribute("data-sample") == "s500"
        _open(browser, server, "/sample?run=1&id=s500", "/sample")
        assert "".join(s.text for s in browser.find_elements("css selector", "#tokens span.tok")) == "6*7 = 42"
    finally:
        store.close()
