"""The dashboard in a real browser (headless Chromium through Selenium) against the store of
a real short LocalRL run: every page renders without console errors, filters and sorting
change the rows, token views load when opened and show the loss mask, and pages update while
a run trains.

A live table polls every few seconds and is swapped for the answer; the dashboards here poll
once an hour (``REFRESH_S``) and a test refreshes a table when it means to (:func:`refresh`),
except the one that watches a run train, whose pages poll as they do for everyone.

Screenshots of every page are saved to ``.artifacts/dashboard/`` for review. Chromium comes
from Debian (``apt-get install -y chromium chromium-driver``, which ``make test`` runs); when it
is missing these tests fail with that command, they never skip."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers import TESTS

from voltrl._http.serving import serve_in_thread
from voltrl.observability.dashboard import Catalog, dashboard_app

pytestmark = pytest.mark.slow  # a browser, and a training run behind the pages

HERE = TESTS
SHOTS = HERE.parent / ".artifacts" / "dashboard"
INSTALL = "apt-get install -y chromium chromium-driver"
WAIT_S = 60.0
REFRESH_S = 3600
"""How often the tests' live tables poll: never during a test, which refreshes them itself."""


def _browser_paths() -> tuple[str, str]:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        pytest.fail(f"the dashboard's browser tests need Chromium and its driver: {INSTALL}")
    return browser, driver


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from dashboard_run import make_run

    root = tmp_path_factory.mktemp("dashboard-runs")
    make_run(root, steps=2)
    return root


@pytest.fixture(scope="module")
def url(runs_dir: Path) -> Iterator[str]:
    with serve_in_thread(dashboard_app(Catalog([runs_dir]), refresh_s=REFRESH_S)) as server:
        yield server.url


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver_path = _browser_paths()
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)
    options.add_argument("--window-size=1400,1000")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        yield driver
    finally:
        driver.quit()


def visit(driver, url: str, shot: str):
    """Open ``url``, wait until loaded, save a screenshot, and fail on console errors."""
    driver.get(url)
    until(driver, lambda: driver.execute_script("return document.readyState") == "complete")
    driver.save_screenshot(str(SHOTS / f"{shot}.png"))
    errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
    assert not errors, f"console errors on {url}: {errors}"
    return driver


def until(driver, condition, timeout: float = WAIT_S) -> None:
    """Poll ``condition``; an element the live page replaced mid-read counts as not yet."""
    from selenium.common.exceptions import StaleElementReferenceException

    deadline = time.time() + timeout
    while True:
        try:
            if condition():
                return
        except StaleElementReferenceException:
            pass
        if time.time() > deadline:
            raise AssertionError(f"timed out on {driver.current_url}")
        time.sleep(0.2)


def open_part(driver, details) -> None:
    """Open a ``<details>`` whose content is fetched when opened, and wait for it. One with an
    id is waited for by that id: a live page may swap it for a new element meanwhile."""
    key = details.get_attribute("id")
    details.find_element("css selector", ":scope > summary").click()
    if key:
        until(driver, lambda: css(driver, f"details#{key}[data-loaded=yes]"))
    else:
        until(driver, lambda: details.get_attribute("data-loaded") == "yes")


def refresh(driver, region: str) -> None:
    """Refresh the live table ``#region`` now, as its poll does (its own ``hx-get``,
    ``hx-select`` and ``hx-swap``), and wait until the swap has settled: dashboard.js has
    put back what the reader ticked, opened and fetched in it."""
    old = css(driver, f"#{region}[hx-get]")
    assert old, f"#{region} is not a live table on {driver.current_url}"
    driver.execute_script(
        "window.__settled = false;"
        "document.addEventListener('htmx:afterSettle', () => { window.__settled = true; },"
        " {once: true});"
        "const el = arguments[0]; htmx.ajax('GET', el.getAttribute('hx-get'), {source: el});",
        old[0],
    )
    until(driver, lambda: _stale(old[0]) and driver.execute_script("return window.__settled"))


def click(driver, find) -> None:
    """Click what ``find()`` returns once it returns something; found again when a live page
    swaps it out from under the click."""

    def clicked() -> bool:
        element = find()
        if element is None:
            return False
        element.click()
        return True

    until(driver, clicked)


def css(driver, selector: str) -> list:
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, selector)


def test_every_page_renders_without_console_errors(browser, url: str) -> None:
    d = visit(browser, url + "/", "runs")
    rows = css(d, "tr.run-row")
    assert len(rows) == 1 and "dash" in rows[0].text and "finished" in rows[0].text
    assert css(d, ".spark svg polyline"), "the reward sparkline is drawn"

    css(d, "tr.run-row a")[0].click()
    until(d, lambda: css(d, ".chart canvas"))
    visit(d, d.current_url, "run")
    charts = {c.get_attribute("data-metric") for c in css(d, ".chart")}
    assert {"train/reward_mean", "val/reward_mean", "update/loss"} <= charts
    run_id = d.current_url.rstrip("/").rsplit("/", 1)[1]

    visit(d, f"{url}/compare?run={run_id}&run={run_id}", "compare")
    assert css(d, ".chart canvas")

    visit(d, f"{url}/rollouts", "rollouts")
    assert len(css(d, "tr.rollout-row")) == 16  # 2 steps of 2 tasks x 3, 2 validations of 2

    link = css(d, "tr.rollout-row[data-status='succeeded'] a")[0]
    link.click()
    visit(d, d.current_url, "rollout")
    assert css(d, "section.call") and css(d, "tr.attempt")
    events = [e.text for e in css(d, "#outcome .event")]
    assert events and events[0].startswith("verdict") and "letter=" in events[0]
    outcome, call = css(d, "#outcome")[0], css(d, "section.call")[0]
    assert outcome.location["y"] < call.location["y"], "the outcome comes before the calls"
    assert "tool.lookup" not in d.page_source  # the spans are folded, fetched when opened
    open_part(d, css(d, "details#spans")[0])
    assert "tool.lookup" in css(d, "details#spans")[0].text

    visit(d, f"{url}/workers", "workers")
    assert "No attempt is running" in d.page_source


def stored(runs_dir: Path, where: str) -> int:
    """Rollouts of the first run matching a SQL condition, counted in its SQLite file."""
    import sqlite3

    with sqlite3.connect(runs_dir / "dash" / "store.sqlite") as db:
        return db.execute(f"SELECT COUNT(*) FROM rollouts WHERE {where}").fetchone()[0]


def test_filters_and_sorting_change_the_rows(browser, url: str, runs_dir: Path) -> None:
    from selenium.webdriver.support.ui import Select

    d = visit(browser, f"{url}/rollouts", "rollouts-all")
    Select(css(d, "select[name=mode]")[0]).select_by_visible_text("val")
    css(d, "form.filters button[type=submit]")[0].click()
    until(d, lambda: "mode=val" in d.current_url)
    visit(d, d.current_url, "rollouts-val")
    rows = css(d, "tr.rollout-row")
    assert len(rows) == 4 and all(" val " in f" {r.text} " for r in rows)

    visit(d, f"{url}/rollouts?mode=train&min_attempts=2", "rollouts-retried")
    retried = stored(runs_dir, "mode = 'train' AND json_extract(data, '$.attempt_count') >= 2")
    assert retried >= 1 and len(css(d, "tr.rollout-row")) == retried  # task d's first tries

    d = visit(d, f"{url}/rollouts?mode=train", "rollouts-train")
    header = next(a for a in css(d, "a.sort") if a.text.startswith("reward"))
    header.click()
    until(d, lambda: "sort=reward" in d.current_url)
    rewards = [float(c.text) for c in css(d, "tr.rollout-row td.reward")]
    assert rewards == sorted(rewards, reverse=True) and len(rewards) == 12

    d = visit(d, f"{url}/rollouts?agent=checker&mode=val", "rollouts-agent")
    assert len(css(d, "tr.rollout-row")) == 4
    d = visit(d, f"{url}/rollouts?agent=nobody", "rollouts-none")
    assert not css(d, "tr.rollout-row") and "No rollouts match" in d.page_source


def test_token_view_shows_the_loss_mask_and_advantages(browser, url: str) -> None:
    d = visit(browser, f"{url}/rollouts?mode=train&status=succeeded", "rollouts-succeeded")
    links = [a.get_attribute("href") for a in css(d, "tr.rollout-row a[href*='/rollouts/']")]
    merged = None  # a rollout whose two writer calls merged into one row (most do)
    for link in links:
        d.get(link)
        until(d, lambda: css(d, "section.row") or "no training row" in d.page_source)
        for row in css(d, "section.row"):
            open_part(d, css(row, "details.tokens")[0])  # the tokens load when opened
        rows = [r for r in css(d, "section.row") if css(r, ".tok.ctx[data-mask='0']")]
        if rows:
            merged = rows[0]
            break
    assert merged is not None, (
        "no merged row in the run's training rollouts: the writer's greedy first reply no "
        "longer re-tokenizes to its own ids (see dashboard_run.writer_checker)"
    )
    visit(d, d.current_url, "rollout-calls")
    until(d, lambda: css(d, "section.row"))
    for row in css(d, "section.row"):
        open_part(d, css(row, "details.tokens")[0])
    merged = next(r for r in css(d, "section.row") if css(r, ".tok.ctx[data-mask='0']"))
    d.execute_script("arguments[0].scrollIntoView()", css(d, "#rows")[0])  # training rows
    d.save_screenshot(str(SHOTS / "token-view.png"))
    credit = css(merged, ".meta.credit")[0].get_attribute("title")
    assert "group" in credit and "mean" in credit, "the tooltip explains the advantage"
    trained = css(merged, ".tok.gen[data-mask='1']")
    fed_in = css(merged, ".tok.ctx[data-mask='0']")
    assert trained and "writer" in merged.text, "the writer's answers are trained"
    assert "Again." in "".join(t.get_attribute("textContent") for t in fed_in)
    assert "advantage" in merged.text and "over the step's batch" in d.page_source
    prompt = css(merged, "details.prompt-tokens")[0]  # after the response, folded
    assert not prompt.get_attribute("open") and css(prompt, ".tok.prompt")

    group = next(a for a in css(d, "a") if a.text == "its group")
    group.click()
    until(d, lambda: css(d, ".group .card"))
    visit(d, d.current_url, "group")
    assert len(css(d, ".group .card")) == 3


def test_a_calls_token_view_loads_when_opened(browser, url: str) -> None:
    """The page carries no token; opening a call's token view fetches it: the response's
    tokens first, the prompt's folded after them."""
    d = visit(browser, f"{url}/rollouts?mode=train&status=succeeded", "rollouts-for-tokens")
    d.get(css(d, "tr.rollout-row a[href*='/rollouts/']")[0].get_attribute("href"))
    until(d, lambda: css(d, "section.call"))
    assert not css(d, "section.call .tok"), "no token is on the page before it is asked for"
    view = css(d, "section.call details.tokens")[0]
    open_part(d, view)
    generated = css(view, ".response-tokens .tok.gen")
    assert generated and all(t.is_displayed() for t in generated[:3])
    prompt = css(view, "details.prompt-tokens")[0]
    assert not prompt.get_attribute("open") and not css(view, ".tok.prompt")[0].is_displayed()
    css(prompt, "summary")[0].click()
    until(d, lambda: css(view, ".tok.prompt")[0].is_displayed())
    visit(d, d.current_url, "rollout-call-tokens")  # no console error on the way


def test_a_live_rollout_keeps_the_token_view_it_opened(browser, tmp_path: Path) -> None:
    """A running rollout's page refreshes every few seconds: an opened token view stays open
    with its tokens, and is not fetched again. The test refreshes the page once the tokens
    are in (a refresh while they load fetches them again, for the view swapped in open)."""
    import asyncio

    from voltrl.store.sql import SQLStore
    from voltrl.types import LLMCall, Run, Task

    async def running() -> str:
        store = SQLStore(tmp_path / "live-rollout" / "store.sqlite")
        try:
            run = await store.add_run(Run(name="live-rollout", kind="dev"))
            await store.enqueue([Task(input={"q": 1})], run_id=run.run_id)
            claim = await store.claim("worker-0", lease_s=600)
            assert claim is not None
            rid = claim.rollout.rollout_id
            answer = {"role": "assistant", "content": "hello"}
            call = LLMCall(
                rollout_id=rid,
                attempt_id=claim.attempt.attempt_id,
                request={"messages": [{"role": "user", "content": "hi"}]},
                response={"choices": [{"index": 0, "message": answer}]},
                prompt_token_ids=[1, 2, 3],
                response_token_ids=[4, 5],
                response_logprobs=[-0.1, -0.2],
            )
            await store.add_llm_calls([call])
            return rid
        finally:
            await store.close()

    rollout_id = asyncio.run(running())
    with serve_in_thread(dashboard_app(Catalog([tmp_path]), refresh_s=REFRESH_S)) as server:
        d = visit(browser, f"{server.url}/rollouts/{rollout_id}", "rollout-live")
        d.execute_script(
            "window.__fetched = []; const f = window.fetch;"
            "window.fetch = (url, ...rest) => { window.__fetched.push(String(url)); "
            "return f(url, ...rest); };"
        )
        open_part(d, css(d, "details#t-1-0")[0])
        tokens = "details#t-1-0[open][data-loaded=yes] .tok.gen"
        until(d, lambda: [t.text.strip() for t in css(d, tokens)] == ["#4", "#5"])
        section = css(d, "section.call")[0]
        refresh(d, "rollout")
        assert _stale(section), "the page was swapped"
        until(d, lambda: [t.text.strip() for t in css(d, tokens)] == ["#4", "#5"])
        fetched = d.execute_script("return window.__fetched")
        assert [u for u in fetched if u.endswith("/tokens")] == [
            f"/rollouts/{rollout_id}/calls/1/0/tokens"
        ]


def test_the_token_drift_audit_on_the_run_page_and_in_a_calls_token_view(
    browser, tmp_path: Path
) -> None:
    """The run page fetches its audit once loaded (the diverging call a link to its
    rollout) and charts the mismatch curves among the main ones, after the reward; the
    call's token view says which check diverges and marks that prompt token."""
    from dashboard_drift import MISMATCH, SPLIT_AT, make_drift_run

    drift = make_drift_run(tmp_path)
    with serve_in_thread(dashboard_app(Catalog([tmp_path]), refresh_s=REFRESH_S)) as server:
        d = visit(browser, f"{server.url}/runs/{drift.run_id}", "run-audit")
        until(d, lambda: css(d, "#audit[data-loaded=yes] .audit-summary"))
        summary = css(d, ".audit-summary")[0]
        assert summary.get_attribute("data-diverging") == "1"
        assert summary.get_attribute("data-trained-drift") == "1"
        assert "every trained token was sampled" not in summary.text
        until(d, lambda: css(d, ".chart canvas"))
        d.execute_script("arguments[0].scrollIntoView()", summary)
        d.save_screenshot(str(SHOTS / "run-audit.png"))
        main = [c.get_attribute("data-metric") for c in css(d, "#charts > .chart")]
        assert main[: 1 + len(MISMATCH)] == ["train/reward_mean", *MISMATCH]
        # each says what it measures, in what unit
        note = css(d, "#charts > .chart[data-metric='mismatch/logprob_abs_mean'] .chart-note")
        assert "(nats)" in note[0].text

        css(d, f".audit-calls a[href$='/rollouts/{drift.drift}']")[0].click()
        until(d, lambda: css(d, "section.call"))
        view = css(d, "details#t-1-1")[0]
        open_part(d, view)
        check = css(view, ".audit .check[data-check=continuation]")[0]
        assert f"diverges at {SPLIT_AT}" in check.text and "diverges" in check.get_attribute(
            "class"
        )
        prompt = css(view, "details.prompt-tokens")[0]
        assert f"diverges at {SPLIT_AT}" in css(prompt, "summary")[0].text
        css(prompt, "summary")[0].click()
        marked = css(view, ".tok.prompt[data-drift]")
        until(d, lambda: marked[0].is_displayed())
        assert [m.get_attribute("data-drift") for m in marked] == [str(SPLIT_AT)]
        tokens = css(view, ".tok.prompt")
        assert tokens[SPLIT_AT] == marked[0]  # the token at that position, counted from 0
        d.execute_script("arguments[0].scrollIntoView({block: 'center'})", marked[0])
        d.save_screenshot(str(SHOTS / "call-drift.png"))
        visit(d, d.current_url, "rollout-drift")  # no console error on the way


def test_signing_in_and_out_through_the_page(browser, runs_dir: Path) -> None:
    """With a token: the sign-in form leads back to the page asked for, the session cookie is
    out of scripts' reach and holds no token, and "Sign out" ends it."""
    token = "browser-token"
    with serve_in_thread(dashboard_app(Catalog([runs_dir]), token=token)) as server:
        d = browser
        d.delete_all_cookies()
        d.get(f"{server.url}/rollouts")
        until(d, lambda: css(d, "input[name=token]"))
        assert "/login?next=" in d.current_url and "reading" not in d.page_source
        css(d, "input[name=token]")[0].send_keys(token)
        css(d, "form.login button")[0].click()
        until(d, lambda: css(d, "tr.rollout-row"))
        visit(d, d.current_url, "signed-in")
        assert d.current_url == f"{server.url}/rollouts"
        [cookie] = d.get_cookies()
        assert cookie["name"] == "voltrl_session" and token not in cookie["value"]
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["path"] == "/"
        assert "voltrl_session" not in d.execute_script("return document.cookie")
        css(d, "form.signout button")[0].click()
        until(d, lambda: css(d, "input[name=token]"))
        assert not d.get_cookies()
        d.get(f"{server.url}/")
        until(d, lambda: css(d, "input[name=token]"))  # signed out: the form again


def test_pages_update_while_a_run_trains(browser, runs_dir: Path, tmp_path: Path) -> None:
    """A run trains beside a finished one (in a directory of this test's own: the others'
    counts stay as they are): the runs page and the run's page show it running and its steps
    coming in, by their own polls, never reloading; then ticked runs stay ticked when the
    runs table refreshes, and compare on shared charts."""
    from dashboard_run import GATE

    root = tmp_path / "runs"
    _copy_run(runs_dir / "dash", root / "dash")
    gate = tmp_path / "gate"  # the run's rollouts wait for it: the test has read the page
    env = {**os.environ, "PYTHONPATH": str(HERE), GATE: str(gate)}
    with (
        serve_in_thread(dashboard_app(Catalog([root]))) as server,  # its pages poll every 3 s
        serve_in_thread(dashboard_app(Catalog([root]), refresh_s=REFRESH_S)) as still,
    ):  # both up till the end: no live page is left polling a server that stopped
        d = visit(browser, server.url + "/", "live-before")
        d.execute_script("window.__notReloaded = true")
        training = subprocess.Popen(
            [sys.executable, str(HERE / "dashboard_run.py"), str(root), "6", "live"],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            until(d, lambda: len(css(d, "tr.run-row")) == 2 and "running" in d.page_source)
            d.save_screenshot(str(SHOTS / "live-runs.png"))
            assert d.execute_script("return window.__notReloaded === true"), "the page reloaded"
            click(d, lambda: next((a for a in css(d, "tr.run-row a") if a.text == "live"), None))
            until(d, lambda: css(d, "#versions[hx-get] tbody tr"))  # live: it polls
            d.execute_script("window.__notReloaded = true")
            seen = len(css(d, "#versions tbody tr"))
            gate.touch()  # the run goes on: its next steps are versions not on the page yet
            until(d, lambda: len(css(d, "#versions tbody tr")) > seen)
            until(d, lambda: css(d, ".chart[data-metric='train/reward_mean'] canvas"))
            d.save_screenshot(str(SHOTS / "live-run.png"))
            assert d.execute_script("return window.__notReloaded === true"), "the page reloaded"
            assert training.wait(timeout=300) == 0
            until(d, lambda: d.find_element("id", "run-status").text == "finished")
            errors = [e for e in d.get_log("browser") if e["level"] == "SEVERE"]
            assert not errors, errors
        finally:
            if training.poll() is None:
                training.kill()
                training.wait()
        d = visit(d, still.url + "/", "runs-two")
        ticks = css(d, "tr.run-row input[type=checkbox]")
        assert len(ticks) == 2
        for box in ticks:
            box.click()
        refresh(d, "runs-table")
        boxes = "tr.run-row input[type=checkbox]"
        until(d, lambda: [b.is_selected() for b in css(d, boxes)] == [True, True])
        css(d, "#runs-form button[type=submit]")[0].click()
        until(d, lambda: "/compare" in d.current_url and css(d, ".chart canvas"))
        visit(d, d.current_url, "compare-two")
        assert len(css(d, "h1 a")) == 2


def _copy_run(source: Path, to: Path) -> None:
    """Copy a run directory; its store through SQLite's backup (a page may have it open)."""
    import sqlite3

    shutil.copytree(source, to, ignore=shutil.ignore_patterns("store.sqlite*"))
    read, write = sqlite3.connect(source / "store.sqlite"), sqlite3.connect(to / "store.sqlite")
    try:
        read.backup(write)
    finally:
        read.close()
        write.close()


def _stale(element) -> bool:
    from selenium.common.exceptions import StaleElementReferenceException

    try:
        element.is_displayed()
    except StaleElementReferenceException:
        return True
    return False
