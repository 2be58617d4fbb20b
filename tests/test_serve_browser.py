"""``qkgeom serve`` in a real browser: Debian's headless Chromium driven by Selenium through
/usr/bin/chromedriver (nothing downloads a browser), watching a sweep being written.

The page reloads itself every second while (1) a writer thread stores a planted sweep
through the store API, and (2) a real ``qkgeom sweep --preset smoke`` (local Ray, real
training) runs: the page must show the trials appear (not finished, verdicts
provisional), then finish (terminated, verdicts final), with a rendered chart (an SVG
with line marks) and the verdict table; screenshots are saved under the test's tmp dir.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest
from ci_env import skip_or_fail
from stats_fixtures import make_synthetic_db
from sweep_fixtures import QKGEOM, cli_env
from test_serve import serve_process

CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"


@pytest.fixture
def browser(monkeypatch: pytest.MonkeyPatch):
    if not (Path(CHROMIUM).exists() and Path(DRIVER).exists()):
        skip_or_fail("Debian's chromium and chromium-driver are not installed: "
                     "apt-get install -y chromium chromium-driver")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        skip_or_fail("selenium is not installed: pip install -e '.[dev]'")
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must never fetch anything
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
              "--window-size=1400,2400"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # CSP reports land here
    drv = webdriver.Chrome(service=Service(executable_path=DRIVER), options=opts)
    drv.set_page_load_timeout(120)
    try:
        yield drv
    finally:
        drv.quit()


def _js(drv, script: str):
    """Run ``script`` in the page; None while the page is between reloads."""
    from selenium.common.exceptions import WebDriverException

    try:
        return drv.execute_script(script)
    except WebDriverException:
        return None


def csp_violations(drv) -> list[str]:
    """The browser console's Content-Security-Policy complaints since the last call: the
    page must work under its own policy (qkgeom.web.guard.CSP)."""
    return [e["message"] for e in drv.get_log("browser")
            if "Content Security Policy" in e["message"] or "Refused to" in e["message"]]


def wait_for(drv, script: str, check, what: str, timeout: float = 120.0):
    deadline = time.time() + timeout
    last = None
    while time.time() < deadline:
        last = _js(drv, script)
        if last is not None and check(last):
            return last
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}; last seen: {last!r}")


STATUSES = "return Array.from(document.querySelectorAll('#trials tbody tr')).map(" \
           "r => r.children[5].textContent)"
VERDICTS = "return Array.from(document.querySelectorAll('#claims tbody tr')).map(" \
           "r => r.children[3].textContent)"
LINES = "return document.querySelectorAll('#chart svg path[aria-roledescription=\"line mark\"]'" \
        ").length"


def test_page_watches_a_sweep(browser, tmp_path: Path) -> None:
    url = "sqlite:///" + str(tmp_path / "watch.db")
    from qkgeom.store import open_store

    open_store(url).close()  # an empty database with the schema: the sweep has not started
    proc, base = serve_process(url, "--refresh", "1", "--update-every", "0")
    try:
        browser.get(base + "/")
        wait_for(browser, "return document.body.innerText",
                 lambda t: "No sweeps in this database yet" in t, "the empty index page",
                 timeout=30)
        writer = threading.Thread(target=make_synthetic_db, args=(url,), kwargs=dict(
            sweep="smoke", seeds=5, status="running"))
        writer.start()
        # the sweep appears on the index page by itself (meta refresh)
        wait_for(browser, "return document.querySelectorAll(\"a[href='/sweeps/smoke']\")"
                 ".length", lambda n: n == 1, "the sweep on the index page")
        writer.join()
        browser.get(base + "/sweeps/smoke")
        st = wait_for(browser, STATUSES, lambda s: len(s) == 40, "40 trial rows")
        assert set(st) == {"running"}
        v = wait_for(browser, VERDICTS, lambda v: len(v) == 8, "the verdict table")
        assert all(x.endswith("(provisional)") for x in v), v
        # the trials finish, one by one, while the page reloads
        with open_store(url) as store:
            for tid in store.trials("smoke")["id"].to_list():
                store.set_trial_status(int(tid), "terminated")
        wait_for(browser, STATUSES, lambda s: len(s) == 40 and set(s) == {"terminated"},
                 "every trial terminated")
        v = wait_for(browser, VERDICTS, lambda v: len(v) == 8 and not any(
            "provisional" in x or "earlier data" in x for x in v), "final verdicts")
        assert v[0] == "holds"  # 2-gap: PR_Q > PR_K planted in all 15 trajectories
        assert "not shown" not in v
        n = wait_for(browser, LINES, lambda n: n > 0, "chart line marks")
        assert n == 30  # PR_Q and PR_K per (depth, init, layer): 2 x 15
        box = _js(browser, "const r = document.querySelector('#chart svg')"
                           ".getBoundingClientRect(); return [r.width, r.height]")
        assert box and box[0] > 300 and box[1] > 200
        # pick another metric on the page: the form reloads the chart
        _js(browser, "document.querySelector(\"select[name='metric']\").value = 'entropy';"
                     "document.querySelector(\"select[name='view']\").value = 'trial';"
                     "document.querySelector('#chart-form').submit()")
        wait_for(browser, "return location.search", lambda q: "metric=entropy" in q,
                 "the entropy chart")
        wait_for(browser, LINES, lambda n: n > 30, "per-seed entropy lines")
        shot = tmp_path / "serve.png"
        assert browser.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        # the stylesheet applied (allowed by its hash): the trial table has its borders
        border = _js(browser, "return getComputedStyle(document.querySelector('#trials td'))"
                              ".borderTopStyle")
        assert border == "solid"
        for page in ("/sweeps/smoke/report.html", "/sweeps/smoke/chart.svg", "/nope"):
            browser.get(base + page)
            time.sleep(0.5)
        assert csp_violations(browser) == []
        keep = os.environ.get("QKGEOM_SCREENSHOT_DIR")
        if keep:
            shutil.copy(shot, Path(keep) / "serve.png")
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.ray
def test_page_watches_a_real_smoke_sweep(browser, scratch, wikitext_dir,  # noqa: F811
                                         tmp_path: Path) -> None:
    import subprocess

    from qkgeom.store import open_store

    url = f"sqlite:///{scratch}/smoke.db"
    open_store(url).close()
    # verdicts and charts at most every 3 s: on 2 cores a server recomputing them at every
    # write would compete with the sweep it watches
    server, base = serve_process(url, "--refresh", "1", "--update-every", "3")
    log = open(scratch / "sweep.log", "w")
    sweep = None
    try:
        browser.get(base + "/")
        sweep = subprocess.Popen(
            [QKGEOM, "sweep", "--preset", "smoke", "--name", "smoke", "--db", url, "--data",
             str(wikitext_dir), "--set", "max_steps=120", "--progress-every", "60"],
            env=cli_env(scratch), stdout=log, stderr=subprocess.STDOUT, cwd=scratch)
        wait_for(browser, "return document.querySelectorAll(\"a[href='/sweeps/smoke']\")"
                 ".length", lambda n: n == 1, "the sweep on the index page", timeout=180)
        browser.get(base + "/sweeps/smoke")
        seen: list[list[str]] = []

        def done(statuses: list[str]) -> bool:
            seen.append(statuses)
            return len(statuses) == 11 and set(statuses) == {"terminated"}

        # 4 grid trials + 1 extra baseline seed + 3 arms x 2 seeds (the smoke preset)
        wait_for(browser, STATUSES, done, "11 terminated trials", timeout=400)
        assert sweep.wait(timeout=120) == 0, (scratch / "sweep.log").read_text()[-3000:]
        unfinished = [s for s in seen if s and set(s) != {"terminated"}]
        assert unfinished, "the page never showed a trial before it finished"
        assert any({"pending", "running"} & set(s) for s in unfinished)
        v = wait_for(browser, VERDICTS, lambda v: len(v) >= 8 and not any(
            "provisional" in x or "earlier data" in x for x in v), "final verdicts")
        assert set(v) <= {"holds", "not shown", "contradicted", "not enough data"}, v
        n = wait_for(browser, LINES, lambda n: n > 0, "chart line marks")
        assert n == 12  # PR_Q and PR_K per (depth, init, layer): 2 x (1 + 2) x 2 inits
        # provenance: each trial's code column shows its latest attempt's code version and
        # commit, the versions and host in its tooltip, as trial_attempts stores them
        shown = _js(browser, "return Array.from(document.querySelectorAll('#trials tbody tr'))"
                    ".map(tr => [tr.cells[0].textContent, tr.querySelector('td.code')"
                    ".textContent, tr.querySelector('td.code').title])")
        with open_store(url, create=False, readonly=True) as store:
            last = {r["trial_key"]: r for r in store.attempts("smoke").iter_rows(named=True)}
        assert len(shown) == 11
        for key, text, title in shown:
            a = last[key]
            assert text.startswith(a["code_version"]), (key, text)
            if a["git_commit"]:
                assert f"@ {a['git_commit'][:7]}" in text and f"git {a['git_commit']}" in title
            assert f"python {a['python']}, torch {a['torch']}, ray {a['ray']}" in title
        shot = tmp_path / "smoke.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
    finally:
        if sweep is not None and sweep.poll() is None:
            sweep.terminate()
            sweep.wait(timeout=60)
        log.close()
        server.terminate()
        server.wait(timeout=30)
