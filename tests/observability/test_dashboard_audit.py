"""The dashboard's token-drift audit over HTTP: the run page fetches the audit once loaded and
the audit is kept per run; a split continuation is flagged only in trajectory mode; a call's
token view says what each check found and marks the prompt position where one diverges; the
run's mismatch curves come right after its reward. (In a real browser:
test_dashboard_browser.py.)"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dashboard_drift import MISMATCH, SPLIT_AT, DriftRun, make_drift_run

from voltrl._http.serving import serve_in_thread
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.observability.dashboard.audit_part import run_audit_of


@pytest.fixture(scope="module")
def drift(tmp_path_factory: pytest.TempPathFactory) -> DriftRun:
    return make_drift_run(tmp_path_factory.mktemp("dashboard-audit"))


@pytest.fixture(scope="module")
def client(drift: DriftRun) -> Iterator[httpx.Client]:
    with (
        serve_in_thread(dashboard_app(Catalog([drift.run_dir.parent]))) as server,
        httpx.Client(base_url=server.url, timeout=60) as c,
    ):
        yield c


def counts(html: str) -> dict[str, str]:
    return dict(re.findall(r'data-count="(\w+)">([^<]+)<', html))


def test_the_run_page_fetches_its_audit_once_loaded(client: httpx.Client, drift: DriftRun) -> None:
    page = client.get(f"/runs/{drift.run_id}")
    assert page.status_code == 200
    assert 'data-part="audit"' in page.text and "audit-summary" not in page.text  # not waited for
    part = client.get(f"/runs/{drift.run_id}/audit")
    assert part.status_code == 200
    assert counts(part.text) == {
        "audited": "4",  # the three calls of one rollout and the one of the other
        "identical": "3",
        "diverging": "1",
        "not_checkable": "0",
        "merged": "0",
        "trained_drift": "1",
    }
    assert "continuation/first_call 3" in part.text  # counted: each agent's first call
    assert f"continuation diverges at {SPLIT_AT}" in part.text
    assert f'href="/rollouts/{drift.drift}"' in part.text and drift.altered in part.text
    assert "explicit transition 0" in part.text


def test_a_split_continuation_is_flagged_only_where_it_costs_a_merge(
    client: httpx.Client, drift: DriftRun, tmp_path: Path
) -> None:
    """In trajectory mode the writer's answer sent back changed splits its row: flagged. In
    transition mode every call is a row of its own, so the same split costs nothing: counted,
    not flagged, and the page says why."""
    flagged = '<tr class="bad"><th>diverging</th>'
    part = client.get(f"/runs/{drift.run_id}/audit").text
    assert flagged in part and 'data-note="transition"' not in part
    for mode in ("transition", None):  # None: a run that trains no rows (a dev run)
        plain = make_drift_run(tmp_path / str(mode), mode=mode)
        with (
            serve_in_thread(dashboard_app(Catalog([plain.run_dir.parent]))) as server,
            httpx.Client(base_url=server.url, timeout=60) as c,
        ):
            part = c.get(f"/runs/{plain.run_id}/audit").text
        assert counts(part)["diverging"] == "1"
        assert flagged not in part and "<tr><th>diverging</th>" in part
        noted = 'data-note="transition"' in part and "a split costs it nothing" in part
        assert noted == (mode == "transition")  # a dev run trains in no mode


async def test_a_runs_audit_is_kept_while_none_of_its_rollouts_changes(drift: DriftRun) -> None:
    catalog = Catalog([drift.run_dir.parent])
    try:
        entry = await catalog.run(drift.run_id)
        async with catalog.hold():
            first = await run_audit_of(entry)
            assert await run_audit_of(entry) is first
    finally:
        await catalog.close()


def test_a_calls_token_view_marks_where_its_prompt_diverges(
    client: httpx.Client, drift: DriftRun
) -> None:
    second = client.get(f"/rollouts/{drift.drift}/calls/1/1/tokens").text
    assert "template: identical" in second
    assert "continuation of " in second and f"diverges at {SPLIT_AT}" in second
    assert re.findall(r'data-drift="(\d+)"', second) == [str(SPLIT_AT)]
    assert f"prompt: 31 tokens · diverges at {SPLIT_AT}" in second
    first = client.get(f"/rollouts/{drift.drift}/calls/1/0/tokens").text
    assert "template: identical" in first and "first call of its agent" in first
    assert "data-drift" not in first


def test_the_mismatch_curves_come_right_after_the_reward(
    client: httpx.Client, drift: DriftRun
) -> None:
    series = client.get(f"/api/runs/{drift.run_id}").json()["series"]
    names = [name for name, _, _ in series]
    assert names == ["train/reward_mean", *MISMATCH, "update/loss"]


def test_the_recorded_trajectory_settings_load_for_a_run_that_re_tokenized() -> None:
    """A run that re-tokenized calls recorded no retokenizer: its settings still load for the
    rollout page's rows and the audit (a retokenizer that refuses stands in), settings of a
    later version are left out, and a value this version does not take is a ValueError."""
    from voltrl.errors import VoltRLError
    from voltrl.observability.audit_views import recorded_trajectory
    from voltrl.types import LLMCall, Run

    recorded = {"mode": "trajectory", "missing_token_ids": "retokenize", "from_the_future": 1}
    settings = recorded_trajectory(Run(name="r", kind="fit", config={"trajectory": recorded}))
    assert settings.mode == "trajectory" and settings.missing_token_ids == "retokenize"
    assert settings.retokenizer is not None
    with pytest.raises(VoltRLError, match="retokenizer is not recorded"):
        settings.retokenizer(LLMCall(rollout_id="r", attempt_id="a"))
    with pytest.raises(ValueError, match="mode"):
        recorded_trajectory(Run(name="r", kind="fit", config={"trajectory": {"mode": "odd"}}))
