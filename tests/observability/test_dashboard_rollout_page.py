"""The rollout page over HTTP: the outcome first (a long event value whole on a click), the
calls as one conversation, token views and spans only when asked for, pages of a long game
under a megabyte; the rollouts list's event filter; steps of a resumed run; what an anonymous
visitor's pages show. (In a real browser: test_dashboard_browser.py.)"""

from __future__ import annotations

import asyncio
import html
import json
import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from dashboard_game import Game, make_game_run

from voltrl._http.serving import serve_in_thread
from voltrl.observability.dashboard import Catalog, dashboard_app
from voltrl.store.sql import SQLStore
from voltrl.types import AttemptResult, LLMCall, Run, Span, Task

MB = 1_000_000


@pytest.fixture(scope="module")
def game(tmp_path_factory: pytest.TempPathFactory) -> Game:
    return make_game_run(tmp_path_factory.mktemp("dashboard-game"))  # 4 rounds, 800 calls


@pytest.fixture(scope="module")
def client(game: Game) -> Iterator[httpx.Client]:
    with (
        serve_in_thread(dashboard_app(Catalog([game.run_dir.parent]))) as server,
        httpx.Client(base_url=server.url, timeout=120) as c,
    ):
        yield c


def parts(page: str) -> list[str]:
    """The parts a page fetches when they are opened."""
    return re.findall(r'data-part="([^"]+)"', page)


@pytest.mark.slow
def test_a_long_game_is_a_small_page_with_no_token_on_it(client: httpx.Client, game: Game) -> None:
    """A 4-round game of 800 calls of 2,500 prompt tokens was a page of tens of megabytes,
    one span per token; now every page of it is under 1 MB and carries no token."""
    for rollout_id in [*game.train, game.val]:
        page = client.get(f"/rollouts/{rollout_id}")
        assert page.status_code == 200
        assert len(page.content) < MB, len(page.content)
        assert 'class="tok' not in page.text
        assert (
            "calls 1\u2013100 of 800" in page.text
            and page.text.count('<section class="call"') == 100
        )
        assert parts(page.text).count("rows") == 1  # fetched once the page has loaded
    last = client.get(f"/rollouts/{game.val}?calls=701")
    assert len(last.content) < MB and "calls 701\u2013800 of 800" in last.text
    assert "call #799" in last.text and "call #699" not in last.text


def test_the_outcome_comes_first_and_the_spans_are_folded(client: httpx.Client, game: Game) -> None:
    page = client.get(f"/rollouts/{game.train[1]}").text
    outcome, conversation, spans = (
        page.index('id="outcome"'),
        page.index("<h2>Conversation"),
        page.index("<h2>Spans"),
    )
    assert outcome < conversation < spans
    head = page[outcome:conversation]
    assert '>winner</span>=<span class="v">wolves<' in head and ">rounds<" in head
    assert "outcome/village" in head and "to agents matching [^/]+/village/.*" in head
    assert "invalid_output" in head and "\u00d7" in head  # the penalties, summed
    assert "chat voltrl-local" not in page  # 1,601 spans: fetched when opened
    tree = client.get(f"/rollouts/{game.train[1]}/spans").text
    assert tree.count('<tr class="span') == 2 * game.calls + 1


def test_each_penalty_is_marked_on_the_call_it_follows(client: httpx.Client, game: Game) -> None:
    """A reward emitted for no agent (the game's ``invalid_output`` penalties, each 0.05 s
    after its call ended) shows under that call, where per-step credit puts it; the outcome
    says so; the sides' outcomes, addressed to agents, mark no call."""
    rollout_id = game.train[1]

    async def penalised() -> set[int]:
        store = SQLStore(game.run_dir / "store.sqlite")
        try:
            calls = {c.ended_at: c.sequence_id for c in await store.get_llm_calls(rollout_id)}
            rewards = await store.get_rewards(rollout_id)
        finally:
            await store.close()
        ends = sorted(calls)
        return {
            calls[max(e for e in ends if e <= r.timestamp)]
            for r in rewards
            if r.name == "invalid_output"
        }

    expected = {k for k in asyncio.run(penalised()) if k < 100}  # the page's first 100 calls
    page = client.get(f"/rollouts/{rollout_id}").text
    sections = re.findall(r'<section class="call" id="call-\d+-(\d+)">(.*?)</section>', page, re.S)
    marked = {int(k) for k, body in sections if 'class="reward-marks"' in body}
    assert expected and marked == expected
    body = dict(sections)[str(min(expected))]
    assert "-0.2" in body and "<code>invalid_output</code>" in body
    assert "emitted after this call" in body and "outcome/" not in body
    assert "per-step credit gives it to the call it follows (marked below)" in page


def test_token_views_come_when_opened_the_response_first(client: httpx.Client, game: Game) -> None:
    page = client.get(f"/rollouts/{game.train[0]}").text
    call = next(p for p in parts(page) if p.endswith("/tokens") and p.startswith("calls/"))
    view = client.get(f"/rollouts/{game.train[0]}/{call}").text
    generated, prompt = view.index('class="tok gen"'), view.index('class="tok prompt"')
    assert generated < prompt and view.count('class="tok gen"') == 24
    assert view.count('class="tok prompt"') == 2500
    assert '<details class="prompt-tokens"><summary>prompt: 2,500 tokens' in view  # folded

    rows = client.get(f"/rollouts/{game.train[0]}/rows").text
    assert rows.count('<section class="row"') == 64  # max_transitions_per_rollout
    row = client.get(f"/rollouts/{game.train[0]}/rows/0/tokens").text
    assert row.index('data-mask="1"') < row.index('class="tok prompt"')
    assert row.count('data-mask="1"') == 24


def test_a_rows_reward_and_advantage_are_explained(client: httpx.Client, game: Game) -> None:
    """Agent-scoped credit: a village player's row of the game the wolves won has reward 0
    and an advantage that is not; the tooltips say why."""
    rows = client.get(f"/rollouts/{game.train[1]}/rows").text
    village = re.search(
        r'<span class="agent">policy/village/[^<]+</span>\s*<span class="meta credit" '
        r'title="([^"]+)">reward 0.000 · advantage <b class="adv (\w+)">(-?[\d.]+)</b>',
        rows,
    )
    assert village is not None, rows[:3000]
    tooltip, _, advantage = village.groups()
    assert float(advantage) != 0.0
    assert "below the mean 0.500 of its group" in tooltip and "rows of group game-0" in tooltip
    legend = re.search(r'<p class="credit-note" title="([^"]+)"', rows)
    assert legend is not None and "agents=..." in legend.group(1)
    assert "GRPO" in legend.group(1) and "A reward of 0 can have a positive advantage" in rows


def test_the_rollouts_list_filters_on_an_event_field(client: httpx.Client, game: Game) -> None:
    def listed(query: str) -> set[str]:
        page = client.get(f"/rollouts?{query}")
        assert page.status_code == 200, page.text
        rows = re.findall(r'<tr class="rollout-row".*?/rollouts/(ro-[0-9a-f]+)"', page.text, re.S)
        return set(rows)

    assert listed("event=winner%3Dwolves") == {game.train[1]}
    assert listed("event=game.winner%3Dvillage") == {game.train[0], game.val}
    assert listed("event=rounds%3D4%2C+winner%3Dvillage&mode=val") == {game.val}
    assert listed("event=episode.winner%3Dvillage") == set()  # no such event
    bad = client.get("/rollouts?event=winner")
    assert bad.status_code == 400 and "write field=value" in bad.text


def test_validation_rollouts_show_their_version(client: httpx.Client, game: Game) -> None:
    page = client.get("/rollouts?mode=val").text
    [row] = re.findall(r'<tr class="rollout-row".*?</tr>', page, re.S)
    assert re.search(r'<td class="n">1</td>', row) and "/group?" not in row


# ---- a chat with tools, as tau2's ---------------------------------------------------------------
SYSTEM = {"role": "system", "content": "You are an airline agent."}
USER = {"role": "user", "content": "Cancel my booking ABC123."}
LOOKUP = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {
            "id": "t1",
            "type": "function",
            "function": {"name": "get_reservation", "arguments": '{"id": "ABC123"}'},
        }
    ],
}
FOUND = {"role": "tool", "tool_call_id": "t1", "content": '{"status": "active"}'}
DONE = {"role": "assistant", "content": "It is cancelled."}
TOOLS = [{"type": "function", "function": {"name": "get_reservation", "parameters": {}}}]


LONG = [{"turn": i, "said": f"line {i}"} for i in range(40)]
"""An event value too long for its line: the page cuts it, and shows it whole on a click."""


def chat_store(path: Path) -> str:
    """A store of one rollout of a tool-using chat: a tool call with no content, the tool's
    result, an answer, the user's goodbye; the episode event tau2 records. Returns its id."""

    async def write() -> str:
        store = SQLStore(path)
        try:
            run = await store.add_run(Run(name="chat", kind="dev", status="finished"))
            await store.enqueue([Task(input={"task": "cancel"})], run_id=run.run_id)
            claim = await store.claim("worker-0")
            assert claim is not None
            rid, aid = claim.rollout.rollout_id, claim.attempt.attempt_id
            turns = [
                ([SYSTEM, USER], LOOKUP),
                ([SYSTEM, USER, LOOKUP, FOUND], DONE),
                ([SYSTEM, USER, LOOKUP, FOUND, DONE, {"role": "user", "content": "Bye."}], DONE),
            ]
            await store.add_llm_calls(
                [
                    LLMCall(
                        rollout_id=rid,
                        attempt_id=aid,
                        agent_name="assistant",
                        request={"messages": messages, "tools": TOOLS},
                        response={"choices": [{"index": 0, "message": answer}]},
                    )
                    for messages, answer in turns
                ]
            )
            episode = Span(
                rollout_id=rid,
                attempt_id=aid,
                name="episode",
                start_time=1.0,
                end_time=1.0,
                attributes={"termination": "user_stop", "reward": 1.0, "turns": LONG},
            )
            await store.complete(
                aid, AttemptResult(status="succeeded", reward=1.0, spans=[episode])
            )
            return rid
        finally:
            await store.close()

    return asyncio.run(write())


def test_a_chat_reads_as_one_conversation(tmp_path: Path) -> None:
    """Each message once (a call shows what is new since the call it continues), a tool
    call without content shows the call and no ``null``, the tools once."""
    rollout_id = chat_store(tmp_path / "chat" / "store.sqlite")
    with (
        serve_in_thread(dashboard_app(Catalog([tmp_path]))) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        page = c.get(f"/rollouts/{rollout_id}").text
        request = c.get(f"/rollouts/{rollout_id}/calls/1/2/request").text
    head = page[: page.index("<h2>Conversation")]
    assert '>termination</span>=<span class="v">user_stop<' in head
    whole = re.search(
        r'<details class="v-whole"><summary class="v">(.*?)</summary><pre>(.*?)</pre>', head, re.S
    )
    assert whole is not None
    line = html.unescape(whole[1])
    assert line.endswith("…") and len(line) == 160  # one short line
    assert json.loads(html.unescape(whole[2])) == LONG  # the whole value, indented
    talk = page[page.index("<h2>Conversation") : page.index("<h2>Training rows")]
    assert talk.count("You are an airline agent.") == 1
    assert talk.count("Cancel my booking ABC123.") == 1
    assert talk.count("→ get_reservation({&#34;id&#34;: &#34;ABC123&#34;})") == 1
    assert talk.count("{&#34;status&#34;: &#34;active&#34;}") == 1 and "Bye." in talk
    assert "null" not in talk and talk.count("<code>get_reservation</code>") == 1
    assert "3 earlier messages, as in call #0" in talk  # its request and response
    assert "5 earlier messages, as in call #1" in talk
    assert request.count('<div class="msg') == 6 and "You are an airline agent." in request


# ---- runs ---------------------------------------------------------------------------------------
def test_a_resumed_run_counts_its_steps_once(tmp_path: Path) -> None:
    """Interrupted in its second step (its unfinished rollouts cancelled), resumed: that step
    is done again at a new version. Three steps, not four."""

    async def write() -> None:
        store = SQLStore(tmp_path / "resumed" / "store.sqlite")
        try:
            run = await store.add_run(Run(name="resumed", kind="fit", status="finished"))
            for version, statuses in [
                (1, ["succeeded"] * 4),
                (2, ["succeeded", "cancelled", "cancelled", "succeeded"]),  # interrupted
                (3, ["succeeded"] * 4),  # the resumed run does step 2 again
                (4, ["succeeded"] * 4),
            ]:
                tasks = [Task(input={"i": i}) for i in range(len(statuses))]
                queued = await store.enqueue(tasks, run_id=run.run_id, resources_version=version)
                for rollout, status in zip(queued, statuses, strict=True):
                    if status == "cancelled":
                        await store.cancel(rollout.rollout_id)
                        continue
                    claim = await store.claim("worker-0")
                    assert claim is not None and claim.rollout.rollout_id == rollout.rollout_id
                    result = AttemptResult(status="succeeded", reward=1.0)
                    await store.complete(claim.attempt.attempt_id, result)
        finally:
            await store.close()

    asyncio.run(write())
    with (
        serve_in_thread(dashboard_app(Catalog([tmp_path]))) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        [row] = re.findall(r'<tr class="run-row".*?</tr>', c.get("/").text, re.S)
        cells = re.findall(r'<td class="n">([^<]*)<', row)
        assert cells[0] == "3", row
        run_id = re.search(r'data-run-id="([^"]+)"', row).group(1)  # type: ignore[union-attr]
        assert "· 3 steps ·" in c.get(f"/runs/{run_id}").text


def test_the_sign_in_page_shows_no_navigation(tmp_path: Path) -> None:
    chat_store(tmp_path / "chat" / "store.sqlite")
    token = "nav-token"
    with (
        serve_in_thread(dashboard_app(Catalog([tmp_path]), token=token)) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        anonymous = c.get("/login").text
        assert ">Rollouts</a>" not in anonymous and ">Workers</a>" not in anonymous
        assert ">Runs</a>" not in anonymous
        assert ">Rollouts</a>" not in c.get("/nope").text  # an anonymous error page
        c.post("/login", data={"token": token})
        assert ">Rollouts</a>" in c.get("/").text


def test_the_event_filter_pages_and_says_when_it_stopped_looking() -> None:
    from voltrl.observability.dashboard import event_filter
    from voltrl.store.browse import RolloutQuery
    from voltrl.store.memory import InMemoryStore

    store = InMemoryStore()

    async def fill() -> None:
        await store.enqueue([Task(input={"i": i}) for i in range(7)])
        for i in range(7):
            claim = await store.claim("worker-0")
            assert claim is not None
            ending = "max_turns" if i % 2 == 0 else "user_stop"  # 4 of the 7
            event = Span(
                rollout_id=claim.rollout.rollout_id,
                attempt_id=claim.attempt.attempt_id,
                name="episode",
                start_time=2.0,
                end_time=2.0,
                attributes={"termination": ending},
            )
            result = AttemptResult(status="succeeded", reward=1.0, spans=[event])
            await store.complete(claim.attempt.attempt_id, result)

    asyncio.run(fill())
    with (
        serve_in_thread(dashboard_app(Catalog([store]))) as server,
        httpx.Client(base_url=server.url) as c,
    ):
        first = c.get("/rollouts?event=termination%3Dmax_turns&limit=3").text
        assert "4 rollouts: 1\u20133" in first and 'rel="next"' in first  # all 7 were read
        assert first.count('<tr class="rollout-row"') == 3
        last = c.get("/rollouts?event=termination%3Dmax_turns&limit=3&page=2").text
        assert "4 rollouts: 4\u20134" in last and 'rel="next"' not in last
    conditions = event_filter.parse("termination=max_turns")
    stopped = asyncio.run(event_filter.filter_by_events(store, RolloutQuery(), conditions, cap=3))
    assert stopped.stopped and stopped.scanned == 3 and len(stopped.page.rollouts) == 2
    assert stopped.page.total_capped  # "2+": the rollouts after the first 3 were not read


def test_a_token_that_is_a_line_break_a_tab_or_a_return_is_shown_not_invisible() -> None:
    """A token that decodes to a line break alone took no room in the token view: its span
    could not be seen nor hovered for its logprob."""
    from voltrl.models.tiny import build_tiny_tokenizer
    from voltrl.observability.dashboard.data import tokens

    tokenizer = build_tiny_tokenizer()
    shown = tokens(tokenizer.encode("a b\n\tc\r\nd"), tokenizer)
    assert shown == ["a", " ", "b", "↵\n", "→\t", "c", "␍", "↵\n", "d"]
