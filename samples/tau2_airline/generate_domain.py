"""A generated airline domain in tau2's format, so the sample runs without tau2-bench's data.

``make_domain(seed)`` builds, from one seed: flights between nine airports on 2024-05-13..25
(landed before the domain's clock, in the air at it, some delayed or cancelled after it; seats
and prices per cabin), users with payment methods and saved passengers, reservations, and 45
tasks (seed 0) of four difficulty levels, each with a customer scenario, gold actions and
what must be said:

1. read-only: a flight's status, a gift card's balance (say it);
2. one write: add bags (the free allowance decides what is paid), fix a passenger's name;
3. a judgement: cancel when the policy allows it, refuse when it does not (no write);
   compensate a cancelled flight with a certificate;
4. bookings and flight changes, with prices to add up.

Every task's gold actions are run on the database here; a task whose gold action the tools
refuse is not generated. ``python run.py generate --out DIR`` writes it (see ``write_domain``).
"""

import random
from pathlib import Path
from typing import Any

from airline_db import (
    Action,
    AirlineTask,
    Domain,
    EvaluationCriteria,
    FlightDB,
    Reservation,
    UserInstructions,
    UserScenario,
)
from airline_tools import NOW, AirlineTools, db_copy

HERE = Path(__file__).resolve().parent
AIRPORTS = ("JFK", "LAX", "SFO", "ORD", "ATL", "SEA", "BOS", "MIA", "DEN")
DATES = [f"2024-05-{d:02d}" for d in range(13, 26)]
TODAY = NOW[:10]
CLOCK_HOUR = int(NOW[11:13])
FIRST = (
    "mia",
    "noah",
    "ava",
    "liam",
    "zoe",
    "omar",
    "lena",
    "ivan",
    "sara",
    "yusuf",
    "emma",
    "raj",
    "chen",
    "lucia",
    "tom",
    "nina",
)
LAST = ("li", "garcia", "smith", "khan", "rossi", "muller", "kim", "silva", "novak", "brown")
#: Free checked bags per passenger, by membership and cabin (the policy states the same).
FREE_BAGS = {
    "regular": {"basic_economy": 0, "economy": 1, "business": 2},
    "silver": {"basic_economy": 1, "economy": 2, "business": 3},
    "gold": {"basic_economy": 2, "economy": 3, "business": 4},
}
COMPENSATION_PER_PASSENGER = 100


def _flights(rng: random.Random) -> dict[str, Any]:
    flights = {}
    routes = [(a, b) for a in AIRPORTS for b in AIRPORTS if a != b]
    for n, (origin, destination) in enumerate(rng.sample(routes, 30), start=1):
        dep = rng.randrange(6, 21)
        hours = rng.randrange(2, 7)
        arr = dep + hours
        arrival = f"{arr % 24:02d}:30:00" + ("+1" if arr >= 24 else "")
        dates = {}
        for day in DATES:
            if day < TODAY or (day == TODAY and arr < CLOCK_HOUR):
                dates[day] = {"status": "landed"}
            elif day == TODAY and dep < CLOCK_HOUR:
                dates[day] = {"status": "flying"}
            elif rng.random() < 0.08:
                dates[day] = {"status": "cancelled"}
            elif day <= DATES[4] and rng.random() < 0.15:
                late = f"{(dep + 2) % 24:02d}:00:00"
                dates[day] = {"status": "delayed", "estimated_departure_time_est": late}
            else:
                seats = {
                    "basic_economy": rng.randrange(0, 12),
                    "economy": rng.randrange(0, 15),
                    "business": rng.randrange(0, 6),
                }
                prices = {
                    "basic_economy": rng.randrange(50, 100),
                    "economy": rng.randrange(100, 200),
                    "business": rng.randrange(200, 500),
                }
                dates[day] = {"status": "available", "available_seats": seats, "prices": prices}
        number = f"HAT{n:03d}"
        flights[number] = {
            "flight_number": number,
            "origin": origin,
            "destination": destination,
            "scheduled_departure_time_est": f"{dep:02d}:00:00",
            "scheduled_arrival_time_est": arrival,
            "dates": dates,
        }
    return flights


def _users(rng: random.Random) -> dict[str, Any]:
    users = {}
    for i, first in enumerate(FIRST):
        last = rng.choice(LAST)
        uid = f"{first}_{last}_{1000 + rng.randrange(9000)}"
        card = f"credit_card_{rng.randrange(10**6, 10**7)}"
        methods = {
            card: {
                "source": "credit_card",
                "id": card,
                "brand": "visa",
                "last_four": f"{rng.randrange(10**4):04d}",
            }
        }
        if i % 2 == 0:
            gid = f"gift_card_{rng.randrange(10**6, 10**7)}"
            methods[gid] = {"source": "gift_card", "id": gid, "amount": rng.randrange(50, 400)}
        friend = {
            "first_name": rng.choice(FIRST).title(),
            "last_name": rng.choice(LAST).title(),
            "dob": f"19{rng.randrange(60, 99)}-0{rng.randrange(1, 9)}-1{rng.randrange(10)}",
        }
        users[uid] = {
            "user_id": uid,
            "name": {"first_name": first.title(), "last_name": last.title()},
            "address": {"city": "Springfield", "country": "USA"},
            "email": f"{first}.{last}@example.com",
            "dob": f"19{rng.randrange(55, 99)}-0{rng.randrange(1, 9)}-2{rng.randrange(8)}",
            "membership": ("regular", "silver", "gold")[i % 3],
            "payment_methods": methods,
            "saved_passengers": [friend],
            "reservations": [],
        }
    return users


def _reservations(
    rng: random.Random, flights: dict[str, Any], users: dict[str, Any]
) -> dict[str, Any]:
    reservations = {}
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"
    for uid, user in users.items():
        for k in range(2):
            number = rng.choice(sorted(flights))
            flight = flights[number]
            day = rng.choice([d for d in DATES if d != TODAY])
            cabin = rng.choice(("basic_economy", "economy", "economy", "business"))
            status = flight["dates"][day]
            price = (status.get("prices") or {}).get(cabin, 150)
            me = {
                "first_name": user["name"]["first_name"],
                "last_name": user["name"]["last_name"],
                "dob": user["dob"],
            }
            people = [me, *user["saved_passengers"][: rng.randrange(2)]]
            card = next(iter(user["payment_methods"]))
            insurance = rng.choice(("yes", "no"))
            rid = "".join(rng.choice(letters) for _ in range(6))
            recent = k == 1 and rng.random() < 0.4
            bags = rng.randrange(0, 2)
            total = price * len(people) + 30 * len(people) * (insurance == "yes")
            reservations[rid] = {
                "reservation_id": rid,
                "user_id": uid,
                "origin": flight["origin"],
                "destination": flight["destination"],
                "flight_type": "one_way",
                "cabin": cabin,
                "flights": [
                    {
                        "origin": flight["origin"],
                        "destination": flight["destination"],
                        "flight_number": number,
                        "date": day,
                        "price": price,
                    }
                ],
                "passengers": people,
                "payment_history": [{"payment_id": card, "amount": total}],
                "created_at": "2024-05-14T19:10:00" if recent else "2024-05-02T10:00:00",
                "total_baggages": bags,
                "nonfree_baggages": 0,
                "insurance": insurance,
            }
            user["reservations"].append(rid)
    return reservations


def _task(
    kind: str,
    level: int,
    reason: str,
    known: str,
    behave: str,
    actions: list[Action] | None = None,
    say: list[str] | None = None,
) -> AirlineTask:
    return AirlineTask(
        id="",
        description={"purpose": reason, "kind": kind, "difficulty": level},
        user_scenario=UserScenario(
            persona="A busy traveller who answers questions briefly.",
            instructions=UserInstructions(
                reason_for_call=reason,
                known_info=known,
                unknown_info="You do not know any other ids or prices.",
                task_instructions=behave,
            ),
        ),
        evaluation_criteria=EvaluationCriteria(
            actions=actions or [], communicate_info=say or [], reward_basis=["DB", "COMMUNICATE"]
        ),
    )


def _action(name: str, **arguments: object) -> Action:
    return Action(action_id=name, name=name, arguments=arguments)


YES = "If the agent asks you to confirm, say yes."


def _tasks(rng: random.Random, db: FlightDB) -> list[AirlineTask]:
    """Tasks of every kind, drawn from ``db``."""
    users, res = db.users, db.reservations
    future = [r for r in res.values() if r.flights[0].date > TODAY]
    out: list[AirlineTask] = []

    def who(uid: str) -> str:
        u = users[uid]
        return f"You are {u.name.first_name} {u.name.last_name}. Your user id is {uid}."

    # compensation first: it cancels a flight, which the other tasks then see
    compensated = [r for r in future if users[r.user_id].membership != "regular"][:4]
    for r in compensated:
        leg = r.flights[0]
        db.flights[leg.flight_number].dates[leg.date] = (
            db.flights[leg.flight_number]
            .dates[leg.date]
            .model_copy(update={"status": "cancelled", "available_seats": None, "prices": None})
        )
        amount = COMPENSATION_PER_PASSENGER * len(r.passengers)
        act = _action("send_certificate", user_id=r.user_id, amount=amount)
        out.append(
            _task(
                "compensation",
                3,
                f"Your flight {leg.flight_number} on {leg.date} "
                f"(reservation {r.reservation_id}) was cancelled and you want "
                "compensation.",
                who(r.user_id),
                YES,
                [act],
            )
        )
    future = [r for r in future if r not in compensated]

    # 1. read-only: two flights of each status (so no guess is right more than a quarter)
    by_status: dict[str, list[tuple[str, str]]] = {}
    for number, flight in sorted(db.flights.items()):
        for day, s in sorted(flight.dates.items()):
            by_status.setdefault(s.status, []).append((number, day))
    asked = [
        pair
        for status in ("landed", "delayed", "cancelled", "available")
        for pair in rng.sample(by_status.get(status, []), min(2, len(by_status.get(status, []))))
    ]
    for number, day in asked:
        status = db.flights[number].dates[day].status
        out.append(
            _task(
                "flight_status",
                1,
                f"You want to know the status of flight {number} on {day}.",
                "",
                "Stop once you are told the status.",
                say=[status],
            )
        )
    with_gift = [u for u in users.values() if any(k.startswith("gift") for k in u.payment_methods)]
    for u in with_gift[:6]:
        balance = next(m for m in u.payment_methods.values() if m.source == "gift_card").amount
        out.append(
            _task(
                "gift_card_balance",
                1,
                "You want to know the balance of your gift card.",
                who(u.user_id),
                "Stop once you are told the balance.",
                say=[str(int(balance))],
            )
        )
    # 2. one write
    for r in [r for r in future if r.cabin != "basic_economy"][:8]:
        u = users[r.user_id]
        card = next(k for k in u.payment_methods if k.startswith("credit"))
        total = r.total_baggages + 1
        free = FREE_BAGS[u.membership][r.cabin] * len(r.passengers)
        act = _action(
            "update_reservation_baggages",
            reservation_id=r.reservation_id,
            total_baggages=total,
            nonfree_baggages=max(0, total - free),
            payment_id=card,
        )
        out.append(
            _task(
                "add_bag",
                2,
                f"You want to add one checked bag to reservation {r.reservation_id}.",
                who(u.user_id) + f" You pay with {card}.",
                YES,
                [act],
            )
        )
    for r in [r for r in future if len(r.passengers) == 1][:4]:
        p = r.passengers[0]
        fixed = {"first_name": p.first_name, "last_name": p.last_name + "e", "dob": p.dob}
        act = _action(
            "update_reservation_passengers", reservation_id=r.reservation_id, passengers=[fixed]
        )
        out.append(
            _task(
                "fix_name",
                2,
                f"Your last name is misspelled on reservation "
                f"{r.reservation_id}: it should be {fixed['last_name']}.",
                who(r.user_id),
                YES,
                [act],
            )
        )

    # 3. judgement: cancel or refuse (compensation is above)
    def allowed(r: Reservation) -> bool:
        cancelled_by_airline = any(
            db.flights[f.flight_number].dates[f.date].status == "cancelled" for f in r.flights
        )
        return (
            r.created_at >= "2024-05-14T15:00:00" or r.cabin == "business" or cancelled_by_airline
        )

    for r in [r for r in future if allowed(r)][:6]:
        act = _action("cancel_reservation", reservation_id=r.reservation_id)
        out.append(
            _task(
                "cancel",
                3,
                f"You want to cancel reservation {r.reservation_id} because your plans changed.",
                who(r.user_id),
                YES,
                [act],
            )
        )
    refuse = [r for r in future if not allowed(r) and r.insurance == "no"]
    for r in refuse[:5]:
        out.append(
            _task(
                "cancel_refused",
                3,
                f"You want to cancel reservation {r.reservation_id} because your plans changed.",
                who(r.user_id),
                "If the agent says it cannot be cancelled, accept it and stop.",
            )
        )
    # 4. bookings and changes
    bookable = [
        (n, d, f)
        for n, f in sorted(db.flights.items())
        for d, s in f.dates.items()
        if s.status == "available" and (s.available_seats or {}).get("economy", 0) > 1
    ]
    for u in list(users.values())[:4]:
        number, day, flight = rng.choice(bookable)
        price = (flight.dates[day].prices or {})["economy"]
        card = next(k for k in u.payment_methods if k.startswith("credit"))
        me = {"first_name": u.name.first_name, "last_name": u.name.last_name, "dob": u.dob}
        act = _action(
            "book_reservation",
            user_id=u.user_id,
            origin=flight.origin,
            destination=flight.destination,
            flight_type="one_way",
            cabin="economy",
            flights=[{"flight_number": number, "date": day}],
            passengers=[me],
            payment_methods=[{"payment_id": card, "amount": price}],
            total_baggages=0,
            nonfree_baggages=0,
            insurance="no",
        )
        out.append(
            _task(
                "book",
                4,
                f"You want to book flight {number} from {flight.origin} to "
                f"{flight.destination} on {day}, economy, one way, for yourself only.",
                who(u.user_id) + f" You pay with {card}.",
                YES + " You want no bags and no insurance.",
                [act],
                [str(price)],
            )
        )
    for r in [r for r in future if r.cabin != "basic_economy"][8:12]:
        leg = r.flights[0]
        later = [
            d
            for d in DATES
            if d > leg.date and db.flights[leg.flight_number].dates[d].status == "available"
        ]
        if not later:
            continue
        card = next(k for k in users[r.user_id].payment_methods if k.startswith("credit"))
        act = _action(
            "update_reservation_flights",
            reservation_id=r.reservation_id,
            cabin=r.cabin,
            flights=[{"flight_number": leg.flight_number, "date": later[0]}],
            payment_id=card,
        )
        out.append(
            _task(
                "change_date",
                4,
                f"You want to move reservation {r.reservation_id} to "
                f"the same flight on {later[0]}.",
                who(r.user_id) + f" You pay any difference with {card}.",
                YES,
                [act],
            )
        )
    return out


def _feasible(db: FlightDB, task: AirlineTask) -> bool:
    """Whether the tools accept every gold action of ``task``."""
    tools = AirlineTools(db_copy(db))
    for a in task.evaluation_criteria.actions:
        tools.execute(a.name, a.arguments)
    return not any(c.error for c in tools.calls)


def make_domain(seed: int = 0, policy: str | None = None, guidelines: str | None = None) -> Domain:
    """The generated domain of ``seed`` (same seed, same domain)."""
    rng = random.Random(seed)
    flights = _flights(rng)
    users = _users(rng)
    db = FlightDB.model_validate(
        {"flights": flights, "users": users, "reservations": _reservations(rng, flights, users)}
    )
    tasks = [t for t in _tasks(rng, db) if _feasible(db, t)]
    by_id, split = {}, {"train": [], "test": []}
    counts: dict[str, int] = {}
    for t in tasks:
        kind = t.description["kind"]
        counts[kind] = counts.get(kind, 0) + 1
        t.id = f"{kind}_{counts[kind]}"
        by_id[t.id] = t
        split["test" if counts[kind] % 4 == 0 else "train"].append(t.id)
    return Domain(
        db=db,
        tasks=by_id,
        split=split,
        policy=policy if policy is not None else (HERE / "policy.md").read_text(),
        guidelines=guidelines
        if guidelines is not None
        else (HERE / "user_guidelines.md").read_text(),
    )
