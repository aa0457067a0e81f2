"""samples/tau2_airline: the airline tools and their rules, the tau2-style evaluator, the loader
of tau2's data format (on the generated domain), and episodes end to end through
``Trainer.dev`` (the Agent Framework assistant against a scripted backend playing the gold
actions, the scripted customer), the agent filter keeping the customer's calls out of
training, and the context-length policy on LocalRL's engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from fake_openai_backend import FakeBackend
from helpers import SAMPLES, chatml_ids, fake_trainer, load_sample

import voltrl as vl
from voltrl.store.memory import InMemoryStore
from voltrl.trajectory import TrajectoryConfig, collate, trajectories_from_store

agent = load_sample("tau2_airline", "agent")  # puts the sample on sys.path for its siblings
run = load_sample("tau2_airline", "run")
import airline_db as db_mod  # noqa: E402
import airline_tools as tools_mod  # noqa: E402
import customers  # noqa: E402
import generate_domain as generate  # noqa: E402
import scoring  # noqa: E402

DOMAIN = generate.make_domain(0)


def tools_on_copy() -> Any:
    return tools_mod.AirlineTools(tools_mod.db_copy(DOMAIN.db))


def a_user_with(source: str) -> Any:
    return next(
        u
        for u in DOMAIN.db.users.values()
        if any(m.source == source for m in u.payment_methods.values())
    )


def bookable_flight(cabin: str = "economy") -> tuple[str, str, Any]:
    for number, flight in sorted(DOMAIN.db.flights.items()):
        for day, status in sorted(flight.dates.items()):
            if status.status == "available" and (status.available_seats or {}).get(cabin, 0) >= 2:
                return number, day, flight
    raise AssertionError("no bookable flight")


# ---- the tools ---------------------------------------------------------------------------------


def test_a_booking_takes_seats_and_charges_the_gift_card_it_names():
    tools = tools_on_copy()
    user = a_user_with("gift_card")
    gift = next(k for k, m in user.payment_methods.items() if m.source == "gift_card")
    balance = user.payment_methods[gift].amount
    number, day, flight = bookable_flight()
    status = flight.dates[day]
    seats, price = status.available_seats["economy"], status.prices["economy"]
    total = 2 * price + 2 * tools_mod.INSURANCE_FEE + tools_mod.BAG_FEE
    card = next(k for k in user.payment_methods if k.startswith("credit"))
    pays = [{"payment_id": gift, "amount": min(int(balance), total)}]
    if total > balance:
        pays.append({"payment_id": card, "amount": total - int(balance)})
    people = [{"first_name": "A", "last_name": "B", "dob": "1990-01-01"}] * 2
    args = {
        "user_id": user.user_id,
        "origin": flight.origin,
        "destination": flight.destination,
        "flight_type": "one_way",
        "cabin": "economy",
        "flights": [{"flight_number": number, "date": day}],
        "passengers": people,
        "payment_methods": pays,
        "total_baggages": 3,
        "nonfree_baggages": 1,
        "insurance": "yes",
    }
    result = json.loads(tools.execute("book_reservation", args))
    assert result["reservation_id"] == "HATHAT" and result["created_at"] == tools_mod.NOW
    db = tools.db
    assert db.flights[number].dates[day].available_seats["economy"] == seats - 2
    assert db.users[user.user_id].payment_methods[gift].amount == balance - pays[0]["amount"]
    assert "HATHAT" in db.users[user.user_id].reservations
    # the same booking paying a cent less is refused, and changes nothing
    before = db.digest()
    wrong = {**args, "payment_methods": [{"payment_id": card, "amount": total - 1}]}
    answer = tools.execute("book_reservation", wrong)
    assert answer == f"Error: the payments add up to {total - 1} but the total price is {total}"
    assert db.digest() == before and tools.calls[-1].error


def test_a_certificate_pays_once_and_is_used_up():
    tools = tools_on_copy()
    user = next(iter(DOMAIN.db.users.values()))
    tools.execute("send_certificate", {"user_id": user.user_id, "amount": 500})
    cert = "certificate_3221322"
    assert tools.db.users[user.user_id].payment_methods[cert].amount == 500
    number, day, flight = bookable_flight()
    price = flight.dates[day].prices["economy"]
    args = {
        "user_id": user.user_id,
        "origin": flight.origin,
        "destination": flight.destination,
        "flight_type": "one_way",
        "cabin": "economy",
        "flights": [{"flight_number": number, "date": day}],
        "passengers": [{"first_name": "A", "last_name": "B", "dob": "1990-01-01"}],
        "payment_methods": [{"payment_id": cert, "amount": price}],
        "total_baggages": 0,
        "nonfree_baggages": 0,
        "insurance": "no",
    }
    assert json.loads(tools.execute("book_reservation", args))["reservation_id"] == "HATHAT"
    assert cert not in tools.db.users[user.user_id].payment_methods
    changed = tools.execute(
        "update_reservation_baggages",
        {"reservation_id": "HATHAT", "total_baggages": 1, "nonfree_baggages": 1,
         "payment_id": cert},
    )  # fmt: skip
    assert changed.startswith("Error: payment method certificate_3221322 not found")


def test_cancelling_refunds_every_payment_but_certificates_and_frees_the_seats():
    tools = tools_on_copy()
    res = next(
        r
        for r in DOMAIN.db.reservations.values()
        if r.status is None
        and any(k.startswith("gift") for k in DOMAIN.db.users[r.user_id].payment_methods)
        and all(DOMAIN.db.flights[f.flight_number].dates[f.date].status == "available"
                for f in r.flights)
    )  # fmt: skip
    user = tools.db.users[res.user_id]
    gift = next(k for k in user.payment_methods if k.startswith("gift"))
    # part of it paid by gift card and by a certificate, to see what is refunded
    tools.db.reservations[res.reservation_id].payment_history += [
        db_mod.Payment(payment_id=gift, amount=20),
        db_mod.Payment(payment_id="certificate_999", amount=50),
    ]
    user.payment_methods[gift].amount -= 20
    leg = res.flights[0]
    seats = tools.db.flights[leg.flight_number].dates[leg.date].available_seats[res.cabin]
    before_gift = user.payment_methods[gift].amount
    out = json.loads(tools.execute("cancel_reservation", {"reservation_id": res.reservation_id}))
    assert out["status"] == "cancelled"
    paid = [p for p in out["payment_history"] if p["amount"] > 0]
    refunds = [p for p in out["payment_history"] if p["amount"] < 0]
    assert sorted((p["payment_id"], -p["amount"]) for p in refunds) == sorted(
        (p["payment_id"], p["amount"]) for p in paid if p["payment_id"] != "certificate_999"
    )
    after = tools.db.flights[leg.flight_number].dates[leg.date].available_seats[res.cabin]
    assert after == seats + len(res.passengers)
    assert user.payment_methods[gift].amount == before_gift + 20
    again = tools.execute("cancel_reservation", {"reservation_id": res.reservation_id})
    assert again == f"Error: reservation {res.reservation_id} is already cancelled"
    bags = {"reservation_id": res.reservation_id, "total_baggages": 9, "nonfree_baggages": 0,
            "payment_id": gift}  # fmt: skip
    assert tools.execute("update_reservation_baggages", bags).endswith("is cancelled")


def test_a_reservation_with_a_flown_flight_cannot_be_cancelled():
    tools = tools_on_copy()
    res = next(
        r
        for r in DOMAIN.db.reservations.values()
        if DOMAIN.db.flights[r.flights[0].flight_number].dates[r.flights[0].date].status == "landed"
    )
    answer = tools.execute("cancel_reservation", {"reservation_id": res.reservation_id})
    assert answer.startswith("Error: flight") and "has already departed" in answer


def test_refused_and_malformed_calls_come_back_as_tool_errors_not_exceptions():
    tools = tools_on_copy()
    assert tools.execute("get_user_details", {"user_id": "nobody"}) == (
        "Error: user nobody not found"
    )
    assert tools.execute("get_user_details", {}).startswith(
        "Error: invalid arguments for get_user_details"
    )
    bad = tools.execute("book_reservation", {"user_id": "x", "flights": "nope"})
    assert bad.startswith("Error: invalid arguments for book_reservation")
    assert tools.execute("drop_table", {}) == "Error: unknown tool 'drop_table'"
    assert tools.execute("calculate", {"expression": "(180 + 30) * 2"}) == "420.0"
    assert tools.execute("calculate", {"expression": "__import__('os')"}).startswith("Error:")
    huge = "9" * 400 + " * " + "9" * 400
    assert tools.execute("calculate", {"expression": huge}).startswith("Error: cannot calculate")
    assert [c.error for c in tools.calls] == [True, True, True, True, False, True, True]


def test_one_stop_search_connects_at_the_first_flights_destination_after_it_lands():
    tools = tools_on_copy()
    # a connection the data holds: A -> B, then B -> C leaving after the first lands
    found = next(
        (first, second, day)
        for first in DOMAIN.db.flights.values()
        for second in DOMAIN.db.flights.values()
        for day, status in sorted(first.dates.items())
        if first.destination == second.origin and second.destination != first.origin
        and status.status == "available" and not first.scheduled_arrival_time_est.endswith("+1")
        and second.scheduled_departure_time_est >= first.scheduled_arrival_time_est
        and getattr(second.dates.get(day), "status", None) == "available"
    )  # fmt: skip
    first, second, day = found
    pairs = json.loads(tools.execute("search_onestop_flight", {
        "origin": first.origin, "destination": second.destination, "date": day}))  # fmt: skip
    assert [first.flight_number, second.flight_number] in [
        [a["flight_number"], b["flight_number"]] for a, b in pairs
    ]
    for a, b in pairs:
        assert a["origin"] == first.origin and b["destination"] == second.destination
        assert a["destination"] == b["origin"]
        if not a["scheduled_arrival_time_est"].endswith("+1"):
            assert b["date"] == day
            assert b["scheduled_departure_time_est"] >= a["scheduled_arrival_time_est"]


def booking(user: Any, **changes: Any) -> dict:
    """Arguments of a valid one-passenger economy booking for ``user``, paid by card."""
    number, day, flight = bookable_flight()
    card = next(k for k in user.payment_methods if k.startswith("credit"))
    args = {
        "user_id": user.user_id,
        "origin": flight.origin,
        "destination": flight.destination,
        "flight_type": "one_way",
        "cabin": "economy",
        "flights": [{"flight_number": number, "date": day}],
        "passengers": [{"first_name": "A", "last_name": "B", "dob": "1990-01-01"}],
        "payment_methods": [{"payment_id": card, "amount": flight.dates[day].prices["economy"]}],
        "total_baggages": 0,
        "nonfree_baggages": 0,
        "insurance": "no",
    }
    return {**args, **changes}


def test_refused_bookings_change_nothing():
    """Payments that game the checks, bad itineraries and bad values are refused before
    anything changes: the database is bit-identical afterwards."""
    tools = tools_on_copy()
    user = a_user_with("gift_card")
    gift = next(k for k, m in user.payment_methods.items() if m.source == "gift_card")
    good = booking(user)
    price, card = good["payment_methods"][0]["amount"], good["payment_methods"][0]["payment_id"]
    leg = good["flights"][0]
    before = tools.db.digest()
    refused = {
        "each payment method may appear once": {"payment_methods": [
            {"payment_id": gift, "amount": price - 1}, {"payment_id": gift, "amount": 1}]},
        "must be positive": {"payment_methods": [
            {"payment_id": gift, "amount": -1000}, {"payment_id": card, "amount": price + 1000}]},
        "appears twice": {"flights": [leg, leg]},
        "at least one flight": {"flights": []},
        "unknown cabin": {"cabin": "first"},
        "invalid arguments": {"insurance": "maybe"},
        "1 to 5 passengers": {"passengers": []},
    }  # fmt: skip
    for message, change in refused.items():
        answer = tools.execute("book_reservation", {**good, **change})
        assert answer.startswith("Error:") and message in answer, (message, answer)
        assert tools.db.digest() == before, message
    assert not tools.execute("book_reservation", good).startswith("Error")


def test_a_flight_change_needs_a_whole_itinerary_without_repeats():
    tools = tools_on_copy()
    task = next(t for t in DOMAIN.tasks.values() if t.description["kind"] == "change_date")
    [gold_change] = task.evaluation_criteria.actions
    args = gold_change.arguments
    before = tools.db.digest()
    for flights, message in (([], "at least one flight"), (args["flights"] * 2, "appears twice")):
        answer = tools.execute("update_reservation_flights", {**args, "flights": flights})
        assert message in answer
    assert tools.db.digest() == before
    assert not tools.execute("update_reservation_flights", args).startswith("Error")


def test_the_tools_are_function_tools_with_their_signatures():
    from agent_framework import FunctionTool

    functions = tools_on_copy().as_functions()
    assert [f.__name__ for f in functions] == list(tools_mod.TOOL_NAMES)
    assert len(functions) == 14
    schema = FunctionTool(name="book_reservation", func=functions[6]).parameters()
    assert schema["properties"]["flights"]["type"] == "array"
    assert "payment_methods" in schema["required"]


# ---- the evaluator -------------------------------------------------------------------------


def gold(task: Any) -> list[tuple[str, dict]]:
    return [(a.name, a.arguments) for a in task.evaluation_criteria.actions]


def said(task: Any) -> list[str]:
    return ["Done. " + ", ".join(task.evaluation_criteria.communicate_info)]


@pytest.mark.parametrize("task_id", sorted(DOMAIN.tasks))
def test_every_generated_tasks_gold_transcript_scores_1(task_id: str):
    task = DOMAIN.tasks[task_id]
    score = scoring.evaluate(task, DOMAIN.db, gold(task), said(task), "user_stop")
    assert score.reward == 1.0, score


def test_a_wrong_write_missing_information_or_a_premature_end_scores_0():
    bags = next(t for t in DOMAIN.tasks.values() if t.description["kind"] == "add_bag")
    status = next(t for t in DOMAIN.tasks.values() if t.description["kind"] == "flight_status")
    [(name, args)] = gold(bags)
    wrong = [(name, {**args, "total_baggages": args["total_baggages"] + 1})]
    score = scoring.evaluate(bags, DOMAIN.db, wrong, said(bags), "user_stop")
    assert (score.reward, score.db, score.communicate) == (0.0, 0.0, 1.0)
    assert scoring.evaluate(bags, DOMAIN.db, [], said(bags), "user_stop").db == 0.0
    info = status.evaluation_criteria.communicate_info
    mute = scoring.evaluate(status, DOMAIN.db, [], ["Let me check."], "user_stop")
    assert (mute.reward, mute.communicate, mute.missing_info) == (0.0, 0.0, info)
    for ending in ("max_steps", "too_many_errors", "agent_error", "context_overflow"):
        early = scoring.evaluate(bags, DOMAIN.db, gold(bags), said(bags), ending)
        assert early.reward == 0.0 and early.db is None


def test_an_unknown_ending_is_an_error_not_a_silent_0():
    task = next(iter(DOMAIN.tasks.values()))
    with pytest.raises(ValueError, match="unknown ending 'stop'"):
        scoring.evaluate(task, DOMAIN.db, [], [], "stop")


def test_any_path_to_the_gold_end_state_passes():
    """A refused call and a different route to the same database state still score 1."""
    bags = next(t for t in DOMAIN.tasks.values() if t.description["kind"] == "add_bag")
    [(name, args)] = gold(bags)
    path = [
        ("get_reservation_details", {"reservation_id": args["reservation_id"]}),
        (name, {**args, "payment_id": "no_such_card"}),  # refused: changes nothing
        (name, args),
    ]
    assert scoring.evaluate(bags, DOMAIN.db, path, said(bags), "user_stop").reward == 1.0
    said_differently = ["The status is " + s.upper() for s in said(bags)]
    assert scoring.evaluate(bags, DOMAIN.db, path, said_differently, "user_stop").reward == 1.0


# ---- tau2's data format --------------------------------------------------------------------------


def test_the_loader_reads_tau2s_format(tmp_path: Path):
    db_mod.write_domain(DOMAIN, tmp_path)
    airline = tmp_path / "tau2" / "domains" / "airline"
    assert sorted(p.name for p in airline.iterdir()) == [
        "db.json", "policy.md", "split_tasks.json", "tasks.json"]  # fmt: skip
    raw = json.loads((airline / "db.json").read_text())
    assert set(raw) == {"flights", "users", "reservations"}
    [first] = json.loads((airline / "tasks.json").read_text())[:1]
    assert set(first) >= {"id", "user_scenario", "evaluation_criteria"}
    assert set(first["evaluation_criteria"]) >= {"actions", "communicate_info", "reward_basis"}
    loaded = db_mod.load_domain(tmp_path)
    assert loaded.db.digest() == DOMAIN.db.digest()
    assert list(loaded.tasks) == list(DOMAIN.tasks) and len(loaded.tasks) >= 40
    assert loaded.split == DOMAIN.split
    assert set(loaded.task_ids("train")).isdisjoint(loaded.task_ids("test"))
    assert loaded.policy == DOMAIN.policy and "###STOP###" in loaded.guidelines


def test_the_loader_keeps_fields_it_does_not_name_and_skips_tasks_with_an_initial_state(
    tmp_path: Path,
):
    db_mod.write_domain(DOMAIN, tmp_path)
    airline = tmp_path / "tau2" / "domains" / "airline"
    tasks = json.loads((airline / "tasks.json").read_text())
    tasks[0]["initial_state"] = {"initialization_actions": []}
    tasks[1]["ticket"] = "free text a newer tau2 adds"
    tasks[1]["user_scenario"]["instructions"] = "You want a refund. Your user id is x_1."
    (airline / "tasks.json").write_text(json.dumps(tasks))
    raw = json.loads((airline / "db.json").read_text())
    next(iter(raw["users"].values()))["loyalty_points"] = 7
    (airline / "db.json").write_text(json.dumps(raw))
    with pytest.warns(UserWarning, match=f"left out 1 task.*{tasks[0]['id']}"):
        loaded = db_mod.load_domain(tmp_path)
    assert tasks[0]["id"] not in loaded.tasks
    assert loaded.tasks[tasks[1]["id"]].model_dump()["ticket"] == "free text a newer tau2 adds"
    assert loaded.db.digest() != DOMAIN.db.digest()  # the extra field is kept, and hashed
    opening = customers.ScriptedUser(loaded.tasks[tasks[1]["id"]].user_scenario).opening()
    assert opening == "I want a refund. My user id is x_1."


def test_the_loader_warns_about_what_it_cannot_score_or_replay(tmp_path: Path):
    db_mod.write_domain(DOMAIN, tmp_path)
    airline = tmp_path / "tau2" / "domains" / "airline"
    tasks = json.loads((airline / "tasks.json").read_text())
    judged = next(t for t in tasks if not t["evaluation_criteria"]["actions"])
    impossible = next(
        t
        for t in tasks
        if "reservation_id" in (t["evaluation_criteria"]["actions"] or [{}])[0].get("arguments", {})
    )
    judged["evaluation_criteria"]["reward_basis"] = ["NL_ASSERTION"]
    impossible["evaluation_criteria"]["actions"][0]["arguments"]["reservation_id"] = "NOPE00"
    (airline / "tasks.json").write_text(json.dumps(tasks))
    with pytest.warns(UserWarning) as caught:
        loaded = db_mod.load_domain(tmp_path)
    said = " | ".join(str(w.message) for w in caught)
    assert f"left out 1 task(s) that only an LLM judge can score: {judged['id']}" in said
    assert f"1 task(s) have gold actions these tools refuse: {impossible['id']}" in said
    assert judged["id"] not in loaded.tasks and impossible["id"] in loaded.tasks
    tasks[2]["user_scenario"] = {"persona": 3}
    (airline / "tasks.json").write_text(json.dumps(tasks))
    with pytest.raises(db_mod.DomainDataError, match=r"tasks\.json: not airline data"):
        db_mod.load_domain(tmp_path)


def test_a_missing_data_file_says_what_to_do(tmp_path: Path):
    with pytest.raises(db_mod.DomainDataError, match=r"db\.json is missing"):
        db_mod.load_domain(tmp_path)


# ---- episodes end to end ---------------------------------------------------------------------


def gold_assistant(tasks: list[Any], confirm: bool = False):
    """A backend script playing the assistant perfectly: the task's gold actions as tool
    calls (with ``confirm``, first asking the customer to confirm, as the policy wants), then
    a message with everything to communicate. Customer requests (no tools) get the scripted
    customer's opening, then ``###STOP###``."""
    by_opening = {customers.ScriptedUser(t.user_scenario).opening(): t for t in tasks}

    def script(req: dict) -> dict:
        messages = req["messages"]
        if not req.get("tools"):  # the customer's model
            if any(m["role"] == "assistant" for m in messages):
                return {"text": "Thanks. ###STOP###"}
            return {"text": next(iter(by_opening))}
        opening = next(m["content"] for m in messages if m["role"] == "user")
        task = by_opening[opening]
        done = sum(m["role"] == "tool" for m in messages)
        actions = task.evaluation_criteria.actions
        confirmed = any(m["role"] == "user" and m["content"].startswith("Yes") for m in messages)
        if done < len(actions) and confirm and not confirmed:
            return {"text": f"I will call {actions[done].name}. Shall I proceed?"}
        if done < len(actions):
            return {"tool": actions[done].name, "arguments": json.dumps(actions[done].arguments)}
        return {"text": "All done. " + " ".join(task.evaluation_criteria.communicate_info)}

    return script


def one_task_per_kind() -> list[Any]:
    chosen: dict[str, Any] = {}
    for task in DOMAIN.tasks.values():
        chosen.setdefault(task.description["kind"], task)
    return list(chosen.values())


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return db_mod.write_domain(DOMAIN, tmp_path_factory.mktemp("tau2"))


@pytest.mark.slow
async def test_episodes_reach_reward_1_through_dev_with_the_scripted_customer(
    tmp_path: Path, data_dir: Path
):
    tasks = one_task_per_kind()
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = gold_assistant(tasks, confirm=True)
        llm = vl.LLM(endpoint=fb.url, model="fake-model")
        trainer = fake_trainer(store, tmp_path, llm, max_concurrency=4)
        rows = agent.task_rows(data_dir, [t.id for t in tasks], user="scripted")
        result = await trainer.dev_async(agent.airline_episode, rows)
    assert len(result.rollouts) == len(tasks) >= 9
    assert [r.reward for r in result.rollouts] == [1.0] * len(tasks)
    for rollout, task in zip(result.rollouts, tasks, strict=True):
        calls = await store.get_llm_calls(rollout.rollout_id)
        assert {c.agent_name for c in calls} == {"assistant"}
        writes = len(task.evaluation_criteria.actions)
        assert len(calls) == writes + 1 + (writes > 0)  # asking to confirm is a turn of its own
        spans = await store.get_spans(rollout.rollout_id)
        [episode] = [s for s in spans if s.name == "episode"]
        assert episode.attributes["termination"] == "user_stop"
        assert episode.attributes["tool_calls"] == len(task.evaluation_criteria.actions)
        tool_spans = [s for s in spans if s.name.startswith("execute_tool ")]
        assert len(tool_spans) == len(task.evaluation_criteria.actions)
        first = calls[0].request
        assert [m["role"] for m in first["messages"]] == ["system", "assistant", "user"]
        assert first["messages"][1]["content"] == agent.Rules().greeting
        assert len(first["tools"]) == 14


@pytest.mark.slow
async def test_agent_framework_conversations_merge_into_one_row_per_episode(
    tmp_path: Path, data_dir: Path
):
    """In trajectory mode each assistant call's prompt (Agent Framework re-renders the whole
    history: earlier tool calls, tool results, customer turns) extends the previous call's
    prompt + response, so an episode is one training row: no merge failure over every task
    of the domain, asking for confirmation first (text turns and tool-call turns)."""
    store = InMemoryStore()
    tasks = list(DOMAIN.tasks.values())
    async with FakeBackend() as fb:
        fb.script = gold_assistant(tasks, confirm=True)
        chatml_ids(fb)
        trainer = fake_trainer(
            store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"), max_concurrency=8
        )
        rows = agent.task_rows(data_dir, [t.id for t in tasks], user="scripted")
        result = await trainer.dev_async(agent.airline_episode, rows)
    assert result.rewards == [1.0] * len(tasks)
    config = TrajectoryConfig(mode="trajectory", agent_filter=agent.AGENT_FILTER)
    trajectories = await trajectories_from_store(store, result.rollouts, config)
    calls = [len(await store.get_llm_calls(r.rollout_id)) for r in result.rollouts]
    assert sum(calls) > 2 * len(tasks)  # most episodes take several assistant calls
    assert [len(t.transitions) for t in trajectories] == [1] * len(tasks)
    assert sum(t.merge_failures for t in trajectories) == 0


def chatty(stop_after: int | None = None, assistant: str = "talk"):
    """A backend script: the assistant never finishes (``talk``: "Let me look into that.";
    ``error``: a call of a tool that does not exist; ``empty``: an empty message); the
    customer (requests without tools) keeps talking, and writes ``###STOP###`` after
    ``stop_after`` assistant messages."""

    def script(req: dict) -> dict:
        messages = req["messages"]
        if not req.get("tools"):
            said = sum(m["role"] == "user" for m in messages) - 1  # the greeting is one
            return {"text": "###STOP###" if said == stop_after else f"Please go on ({said})."}
        if assistant == "error":
            return {"tool": "no_such_tool", "arguments": "{}"}
        return {"text": "" if assistant == "empty" else "Let me look into that."}

    return script


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stop_after", "assistant", "ending", "steps", "customer_calls"),
    [
        (None, "talk", "max_steps", 200, 100),  # tau2's 200 messages: 100 from each side
        (3, "talk", "user_stop", 7, 4),  # the opening, then 3 answers and 3 replies
        (None, "error", "too_many_errors", 21, 1),  # tau2's 10 tool errors, 2 steps each
        (None, "empty", "agent_error", 2, 1),
    ],
    ids=["never-stops", "stops-early", "tool-errors", "empty-message"],
)
async def test_how_an_episode_ends_by_tau2s_rules(
    tmp_path: Path, data_dir: Path, stop_after: int | None, assistant: str, ending: str,
    steps: int, customer_calls: int,
):  # fmt: skip
    """Every message is a step (a batch of tool results is one); an episode ends when the
    customer stops, at 200 steps, at 10 tool errors, or on an empty message, and only a stop
    is scored."""
    task = next(t for t in DOMAIN.tasks.values() if t.description["kind"] == "flight_status")
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = chatty(stop_after, assistant)
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        rows = agent.task_rows(data_dir, [task.id], user="main_llm")
        result = await trainer.dev_async(agent.airline_episode, rows)
    [rollout] = result.rollouts
    [episode] = [s for s in await store.get_spans(rollout.rollout_id) if s.name == "episode"]
    got = episode.attributes
    assert (got["termination"], got["steps"]) == (ending, steps)
    assert got["tool_errors"] == (10 if assistant == "error" else 0)
    assert rollout.status == "succeeded" and rollout.reward == 0.0  # the status was never said
    assert len([r for r in fb.requests if not r["body"].get("tools")]) == customer_calls


async def test_a_refused_gold_path_scores_0_and_the_database_decides(
    tmp_path: Path, data_dir: Path
):
    """The assistant cancels a reservation the policy says cannot be: reward 0."""
    refused = next(t for t in DOMAIN.tasks.values() if t.description["kind"] == "cancel_refused")
    rid = refused.user_scenario.instructions.reason_for_call.split()[5]
    reckless = refused.model_copy(deep=True)
    reckless.evaluation_criteria.actions = [
        db_mod.Action(name="cancel_reservation", arguments={"reservation_id": rid})
    ]
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = gold_assistant([reckless])
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        rows = agent.task_rows(data_dir, [refused.id], user="scripted")
        result = await trainer.dev_async(agent.airline_episode, rows)
    [rollout] = result.rollouts
    assert rollout.status == "succeeded" and rollout.reward == 0.0
    [episode] = [s for s in await store.get_spans(rollout.rollout_id) if s.name == "episode"]
    assert episode.attributes["db"] == 0.0 and episode.attributes["termination"] == "user_stop"


async def test_only_the_assistants_calls_become_training_rows_when_both_roles_share_a_backend(
    tmp_path: Path, data_dir: Path
):
    """The customer is an LLM on the same backend and model as the assistant (``main_llm``):
    with the sample's agent filter the batch holds no customer token; without it, it does
    (so the filter is not a no-op)."""
    task = next(t for t in DOMAIN.tasks.values() if t.description["kind"] == "add_bag")
    store = InMemoryStore()
    async with FakeBackend() as fb:
        fb.script = gold_assistant([task])
        trainer = fake_trainer(store, tmp_path, vl.LLM(endpoint=fb.url, model="fake-model"))
        rows = agent.task_rows(data_dir, [task.id] * 2, user="main_llm")
        result = await trainer.dev_async(agent.airline_episode, rows)
    assert result.rewards == [1.0, 1.0]
    calls = [c for r in result.rollouts for c in await store.get_llm_calls(r.rollout_id)]
    user_calls = [c for c in calls if c.agent_name == "user"]
    assert len(user_calls) == 4 and all(c.has_token_ids for c in calls)

    def batch(agent_filter: str | None) -> Any:
        config = TrajectoryConfig(mode="trajectory", agent_filter=agent_filter)
        return collate(_run(trajectories_from_store(store, result.rollouts, config)), config)

    def generated(calls: list[Any]) -> int:
        return sum(len(c.response_token_ids) for c in calls)

    filtered, everything = batch(agent.AGENT_FILTER), batch(None)
    assert set(filtered.agent_names) == {"assistant"}
    assert filtered.stats["dropped/agent_filter"] == 4
    # the tokens trained on (mask 1) are exactly the assistant's generated ones
    assistant_calls = [c for c in calls if c.agent_name == "assistant"]
    assert sum(map(sum, filtered.response_mask)) == generated(assistant_calls)
    assert sum(map(sum, everything.response_mask)) == generated(calls) > generated(assistant_calls)
    assert "user" in everything.agent_names and len(everything) > len(filtered)


def _run(coro: Any) -> Any:
    import asyncio
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


async def test_a_conversation_outgrowing_the_context_ends_with_reward_0_not_a_crash(
    tmp_path: Path, data_dir: Path
):
    """On LocalRL's engine with a context room for the first turn only, the conversation
    ends ``context_overflow`` (the engine's 400 for the second turn), scored 0, counted in
    the episode event; the rollout itself succeeds."""
    from voltrl.algorithms.local.tiny import build_tiny_model, build_tiny_tokenizer

    task = next(t for t in DOMAIN.tasks.values() if t.description["kind"] == "flight_status")
    async with FakeBackend() as fb:  # the first request, to size the context
        fb.script = gold_assistant([task])
        trainer = fake_trainer(InMemoryStore(), tmp_path, vl.LLM(endpoint=fb.url, model="m"))
        rows = agent.task_rows(data_dir, [task.id], user="scripted")
        await trainer.dev_async(agent.airline_episode, rows)
        first = fb.requests[0]["body"]
    tok = build_tiny_tokenizer()
    text = tok.apply_chat_template(
        first["messages"], tools=first["tools"], add_generation_prompt=True, tokenize=False
    )
    room = len(tok.encode(text, add_special_tokens=False)) + 150
    algo = vl.LocalRL(
        build_tiny_model(tok, seed=0, max_positions=room),
        tokenizer=tok,
        sampling={"temperature": 1.0, "max_tokens": 40},
        seed=1,
    )
    store = InMemoryStore()
    trainer = vl.Trainer(
        algo, store=store, n_runners=1, inline=True, run_dir=tmp_path, progress=False
    )
    rows = agent.task_rows(data_dir, [task.id] * 2, user="main_llm")
    result = await trainer.dev_async(agent.airline_episode, rows)
    for rollout in result.rollouts:
        assert rollout.status == "succeeded" and rollout.reward == 0.0
        spans = await store.get_spans(rollout.rollout_id)
        [episode] = [s for s in spans if s.name == "episode"]
        assert episode.attributes["termination"] == "context_overflow"
        assert episode.attributes["steps"] >= 2  # the customer's opening, the first answer


async def test_the_customer_on_its_own_llm_resource_is_recorded_under_its_name(
    tmp_path: Path, data_dir: Path
):
    """``user_llm``: a second endpoint (a hosted model in real use) plays the customer."""
    task = next(t for t in DOMAIN.tasks.values() if t.description["kind"] == "cancel")
    store = InMemoryStore()
    async with FakeBackend() as assistant_backend, FakeBackend() as customer_backend:
        assistant_backend.script = customer_backend.script = gold_assistant([task])
        resources = {
            "main_llm": vl.LLM(endpoint=assistant_backend.url, model="fake-model"),
            "user_llm": vl.LLM(endpoint=customer_backend.url, model="hosted-model"),
        }
        trainer = vl.Trainer(
            store=store, run_dir=tmp_path, n_runners=1, inline=True, progress=False,
            resources=resources,
        )  # fmt: skip
        rows = agent.task_rows(data_dir, [task.id], user="user_llm")
        result = await trainer.dev_async(agent.airline_episode, rows)
    assert result.rewards == [1.0]
    assert all(not r["body"].get("tools") for r in customer_backend.requests)
    assert all(r["body"].get("tools") for r in assistant_backend.requests)
    calls = await store.get_llm_calls(result.rollouts[0].rollout_id)
    assert [c.agent_name for c in calls if c.request["model"] == "hosted-model"] == ["user"] * 2
    system = next(c for c in calls if c.agent_name == "user").request["messages"][0]["content"]
    assert "<scenario>" in system and task.user_scenario.instructions.reason_for_call in system


@pytest.mark.slow
def test_run_py_generates_a_domain_in_tau2s_layout(tmp_path: Path):
    out = subprocess.run(
        [sys.executable, str(SAMPLES / "tau2_airline" / "run.py"), "generate",
         "--out", str(tmp_path / "data"), "--seed", "3"],
        capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    made = generate.make_domain(3)
    assert f"wrote {len(made.tasks)} tasks" in out.stdout and "--domain generated" in out.stdout
    assert len(made.tasks) >= 40
    loaded = db_mod.load_domain(tmp_path / "data")
    assert loaded.db.digest() == made.db.digest()


def run_py(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SAMPLES / "tau2_airline" / "run.py"), *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_run_py_says_what_is_wrong_in_one_line(tmp_path: Path, data_dir: Path, capsys):
    from helpers import free_port, run_main

    main = run.main
    missing = ("train", "--domain", "generated", "--data", str(tmp_path / "nowhere"),
               "--out", str(tmp_path))  # fmt: skip
    code, _, err = run_main(main, *missing, capsys=capsys)
    assert code == 1 and "Traceback" not in err
    assert "db.json is missing" in err
    folder = ("train", "--domain", "generated", "--data", str(data_dir / "tau2/domains/airline"))
    code, _, err = run_main(main, *folder, capsys=capsys)
    assert "give the directory holding tau2/" in err and code == 1
    no_model = ("train", "--user-endpoint", "http://127.0.0.1:1/v1")
    code, _, err = run_main(main, *no_model, capsys=capsys)
    assert code == 2 and "--user-endpoint needs --user-model" in err
    dead = f"http://127.0.0.1:{free_port()}/v1"
    customer = (
        "dev", "--domain", "generated", "--data", str(data_dir), "--out", str(tmp_path),
        "--endpoint", dead, "--model", "m", "--user-endpoint", dead, "--user-model", "hosted",
    )  # fmt: skip
    code, _, err = run_main(main, *customer, capsys=capsys)
    assert code == 1 and "Traceback" not in err
    assert err.startswith("error: the assistant's endpoint: no OpenAI-compatible")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_run_py_train_with_the_scripted_customer_trains_on_the_assistant_alone(
    tmp_path: Path, data_dir: Path
):
    """The README's first command, smaller: LocalRL on the tiny model, the scripted
    customer (no customer call at all), the episodes' endings reported; its metrics also go
    to TensorBoard (``--loggers``). Its ``train.yaml`` runs it again through ``voltrl train``,
    and a ``--resume`` with another customer is refused, leaving the run as it was."""
    from helpers import voltrl
    from test_loggers import tensorboard_events

    options = ("--domain", "generated", "--data", str(data_dir), "--run-dir", str(tmp_path),
               "--steps", "1", "--tasks-per-step", "1", "--group-size", "2",
               "--n-val", "1", "--max-tokens", "8")  # fmt: skip
    out = run_py("train", *options, "--name", "first", "--loggers", "tensorboard", timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 1: 2 assistant rows (0 merge failures), 0 user calls left out" in out.stdout
    # how the two sampled episodes ended (temperature 1: mostly the customer's stop, now and
    # then an empty message), each a tau2 ending
    ends = re.search(r"^train episodes: (.+)$", out.stdout, re.MULTILINE)
    assert ends, out.stdout
    counts = dict(part.rsplit(" ", 1) for part in ends.group(1).split(", "))
    assert set(counts) <= set(scoring.ENDINGS) and sum(map(int, counts.values())) == 2, counts
    # before and after training: the greedy tiny model writes an empty message (agent_error)
    assert "val episodes: agent_error 2" in out.stdout
    first = tmp_path / "first"
    events = tensorboard_events(first / "tensorboard")
    assert "update/loss" in events.Tags()["scalars"]

    metrics = (first / "metrics.jsonl").read_bytes()
    resumed = run_py("train", *options, "--name", "first", "--resume", "--user", "policy")
    assert resumed.returncode == 1 and "Traceback" not in resumed.stderr
    assert resumed.stderr.startswith("error: cannot resume run 'first' with a different set-up")
    assert 'train data row 1.user is "main_llm" (the run\'s: "scripted")' in resumed.stderr
    assert (first / "metrics.jsonl").read_bytes() == metrics

    again = voltrl("train", str(first / "train.yaml"), cwd=tmp_path, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    lines = (tmp_path / "first-2" / "metrics.jsonl").read_text().splitlines()
    assert [m["step"] for m in map(json.loads, lines) if "update/loss" in m] == [1]
