"""The airline's 14 tools over one :class:`~airline_db.FlightDB`, with the domain's hard rules.

:class:`AirlineTools` is framework-free: ``execute(name, arguments)`` runs a tool and returns
its result as text (JSON), or ``"Error: ..."`` when the request breaks a rule (no seats, a
payment that does not add up, an unknown id): a tool error the model reads, never an
exception. Every executed call is logged in ``calls``, which the evaluator replays.

The tools enforce what the database can check (seats, balances, ids, flights already flown);
judgement calls (may this reservation be cancelled? is compensation due?) are the policy's,
which the assistant must follow and the evaluator checks through the end state.
"""

import ast
import copy
import datetime as dt
import functools
import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from airline_db import (
    CABINS,
    CabinClass,
    Certificate,
    FlightDate,
    FlightDB,
    GiftCard,
    Passenger,
    Payment,
    Reservation,
    ReservationFlight,
    User,
)
from pydantic import BaseModel, ValidationError

#: The domain's clock: every episode happens at this moment (as in tau2's airline data).
NOW = "2024-05-15T15:00:00"
#: What a checked bag beyond the free allowance, and travel insurance, cost (per passenger).
BAG_FEE = 50
INSURANCE_FEE = 30
#: Ids given to new reservations and certificates, in order (deterministic, so a replay of
#: the same calls reaches the same database).
NEW_RESERVATION_IDS = ("HATHAT", "HATHAU", "HATHAV")
NEW_CERTIFICATE_NUMBERS = (3221322, 3221323, 3221324)
FLOWN = ("flying", "landed")
MAX_PASSENGERS = 5
#: The most payment methods of each kind one booking may use (the policy states the same).
PAYMENT_LIMITS = {"certificate": 1, "credit_card": 1, "gift_card": 3}
CITIES = {
    "ATL": "Atlanta",
    "BOS": "Boston",
    "CLT": "Charlotte",
    "DEN": "Denver",
    "DFW": "Dallas",
    "DTW": "Detroit",
    "EWR": "Newark",
    "IAH": "Houston",
    "JFK": "New York",
    "LAS": "Las Vegas",
    "LAX": "Los Angeles",
    "LGA": "LaGuardia",
    "MCO": "Orlando",
    "MIA": "Miami",
    "MSP": "Minneapolis",
    "ORD": "Chicago",
    "PHL": "Philadelphia",
    "PHX": "Phoenix",
    "SEA": "Seattle",
    "SFO": "San Francisco",
}

READ_TOOLS = (
    "get_user_details",
    "get_reservation_details",
    "list_all_airports",
    "search_direct_flight",
    "search_onestop_flight",
    "get_flight_status",
)
WRITE_TOOLS = (
    "book_reservation",
    "cancel_reservation",
    "update_reservation_baggages",
    "update_reservation_flights",
    "update_reservation_passengers",
    "send_certificate",
)
GENERIC_TOOLS = ("calculate", "transfer_to_human_agents")
TOOL_NAMES = READ_TOOLS + WRITE_TOOLS + GENERIC_TOOLS


class ToolError(ValueError):
    """A request the airline refuses; the model sees ``Error: <message>``."""


class FlightInfo(BaseModel):
    """One flight of a booking: its number and date (YYYY-MM-DD)."""

    flight_number: str
    date: str


class PaymentSpec(BaseModel):
    """How much to take from one of the user's payment methods."""

    payment_id: str
    amount: int


@dataclass
class ToolCall:
    """One executed tool call: what was asked and what came back."""

    name: str
    arguments: dict[str, Any]
    result: str
    error: bool


def _dump(value: Any) -> str:
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json", exclude_none=True)
    elif isinstance(value, list):
        value = [
            v.model_dump(mode="json", exclude_none=True) if isinstance(v, BaseModel) else v
            for v in value
        ]
    return value if isinstance(value, str) else json.dumps(value)


_OPS: dict[type, Callable[..., Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}


def _arithmetic(node: ast.AST) -> float:
    """Evaluate numbers, + - * / and parentheses; anything else is a ToolError."""
    if isinstance(node, ast.Expression):
        return _arithmetic(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arithmetic(node.left), _arithmetic(node.right))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_arithmetic(node.operand))
    raise ToolError("only numbers, + - * / and parentheses are allowed")


def _check_cabin(cabin: str) -> None:
    if cabin not in CABINS:
        raise ToolError(f"unknown cabin {cabin!r}: one of {', '.join(CABINS)}")


def _itinerary(flights: list[Any]) -> list[FlightInfo]:
    """The flights of a booking or change: at least one, none twice."""
    legs = [FlightInfo.model_validate(f) for f in flights]
    if not legs:
        raise ToolError("an itinerary needs at least one flight")
    keys = [(leg.flight_number, leg.date) for leg in legs]
    if len(set(keys)) != len(keys):
        raise ToolError("the same flight on the same date appears twice")
    return legs


class AirlineTools:
    """The tools, acting on ``db`` in place (give it a copy)."""

    def __init__(self, db: FlightDB) -> None:
        self.db = db
        self.calls: list[ToolCall] = []

    # ---- running tools ------------------------------------------------------------------
    def execute(self, name: str, arguments: dict[str, Any]) -> str:
        """Run tool ``name`` and log the call; the result as text, ``Error: ...`` when the
        request is refused, malformed, or fails in any other way (never an exception). A
        refused request changes nothing: every check runs before the first change."""
        if name not in TOOL_NAMES:
            result, error = f"Error: unknown tool {name!r}", True
        else:
            try:
                result, error = _dump(getattr(self, name)(**arguments)), False
            except ToolError as e:
                result, error = f"Error: {e}", True
            except (ValidationError, TypeError) as e:
                result, error = f"Error: invalid arguments for {name}: {e}", True
            except Exception as e:  # whatever a request does, the model gets an answer
                result, error = f"Error: {name} failed: {type(e).__name__}: {e}", True
        self.calls.append(ToolCall(name, copy.deepcopy(arguments), result, error))
        return result

    def call(self, call_id: str, name: str, arguments: dict[str, Any]) -> tuple[str, bool]:
        """Run one tool call (:meth:`execute`): ``(result, error)``."""
        result = self.execute(name, arguments)
        return result, self.calls[-1].error

    def schemas(self) -> list[dict[str, Any]]:
        """The tools' OpenAI function schemas, as Agent Framework derives them from the
        signatures and docstrings."""
        from agent_framework import FunctionTool

        functions = self.as_functions()
        return [FunctionTool(name=f.__name__, func=f).to_json_schema_spec() for f in functions]

    def as_functions(self) -> list[Callable[..., str]]:
        """Each tool as a plain function with the tool's signature and docstring that runs it
        through :meth:`execute` (what a framework turns into function tools)."""

        def bind(name: str) -> Callable[..., str]:
            method = getattr(self, name)

            @functools.wraps(method)
            def run(**arguments: Any) -> str:
                return self.execute(name, arguments)

            return run

        return [bind(name) for name in TOOL_NAMES]

    # ---- lookups ---------------------------------------------------------------------------
    def _user(self, user_id: str) -> User:
        if user_id not in self.db.users:
            raise ToolError(f"user {user_id} not found")
        return self.db.users[user_id]

    def _reservation(self, reservation_id: str) -> Reservation:
        if reservation_id not in self.db.reservations:
            raise ToolError(f"reservation {reservation_id} not found")
        return self.db.reservations[reservation_id]

    def _open_reservation(self, reservation_id: str) -> Reservation:
        res = self._reservation(reservation_id)
        if res.status == "cancelled":
            raise ToolError(f"reservation {reservation_id} is cancelled")
        return res

    def _flight_date(self, flight_number: str, day: str) -> FlightDate:
        flight = self.db.flights.get(flight_number)
        if flight is None:
            raise ToolError(f"flight {flight_number} not found")
        if day not in flight.dates:
            raise ToolError(f"flight {flight_number} does not fly on {day}")
        return flight.dates[day]

    def _bookable(self, flight_number: str, day: str, cabin: str, seats: int) -> FlightDate:
        status = self._flight_date(flight_number, day)
        if status.status != "available" or status.prices is None:
            raise ToolError(f"flight {flight_number} on {day} is {status.status}, not bookable")
        if (status.available_seats or {}).get(cabin, 0) < seats:
            raise ToolError(f"not enough {cabin} seats on flight {flight_number} on {day}")
        return status

    def _check_payments(self, user: User, pays: list[PaymentSpec]) -> None:
        """A booking's payments: positive amounts, each method once and on the user's
        profile, balances that cover them, and the policy's limits per kind of method."""
        ids = [p.payment_id for p in pays]
        if len(set(ids)) != len(ids):
            raise ToolError("each payment method may appear once")
        kinds: dict[str, int] = {}
        for pay in pays:
            method = user.payment_methods.get(pay.payment_id)
            if method is None:
                raise ToolError(
                    f"payment method {pay.payment_id} not found for user {user.user_id}"
                )
            if pay.amount <= 0:
                raise ToolError(f"the amount for {pay.payment_id} must be positive")
            if isinstance(method, GiftCard | Certificate) and method.amount < pay.amount:
                raise ToolError(f"{pay.payment_id} has {method.amount}, not {pay.amount}")
            kinds[method.source] = kinds.get(method.source, 0) + 1
        for source, most in PAYMENT_LIMITS.items():
            if kinds.get(source, 0) > most:
                raise ToolError(f"at most {most} {source.replace('_', ' ')}(s) per booking")

    def _book_leg(
        self, leg: FlightInfo, cabin: str, seats: int
    ) -> tuple[ReservationFlight, FlightDate]:
        """A flight of an itinerary at today's price in ``cabin``, and its date's status
        (whose seats the caller takes once every check has passed)."""
        status = self._bookable(leg.flight_number, leg.date, cabin, seats)
        flight = self.db.flights[leg.flight_number]
        booked = ReservationFlight(
            origin=flight.origin,
            destination=flight.destination,
            flight_number=leg.flight_number,
            date=leg.date,
            price=(status.prices or {})[cabin],
        )
        return booked, status

    def _charge(self, user: User, payment_id: str, amount: int) -> Payment | None:
        """Take ``amount`` (negative: refund) for a change to a reservation."""
        method = user.payment_methods.get(payment_id)
        if method is None:
            raise ToolError(f"payment method {payment_id} not found for user {user.user_id}")
        if isinstance(method, Certificate):
            raise ToolError("a certificate cannot pay for a change to a reservation")
        if isinstance(method, GiftCard):
            if method.amount < amount:
                raise ToolError(f"gift card {payment_id} has {method.amount}, not {amount}")
            method.amount -= amount
        return Payment(payment_id=payment_id, amount=amount) if amount else None

    # ---- read tools ------------------------------------------------------------------------
    def get_user_details(self, user_id: str) -> User:
        """The profile of a user: name, membership, payment methods, saved passengers and
        reservation ids.

        Args:
            user_id: the user's id, such as 'sara_doe_496'.
        """
        return self._user(user_id)

    def get_reservation_details(self, reservation_id: str) -> Reservation:
        """A reservation: flights, passengers, cabin, baggage, insurance and payments.

        Args:
            reservation_id: the six-character reservation id, such as 'ZFA04Y'.
        """
        return self._reservation(reservation_id)

    def list_all_airports(self) -> list[dict[str, str]]:
        """Every airport the airline flies to, with its city."""
        codes = sorted(
            {f.origin for f in self.db.flights.values()}
            | {f.destination for f in self.db.flights.values()}
        )
        return [{"iata": c, "city": CITIES.get(c, c)} for c in codes]

    def _direct(
        self, day: str, origin: str | None, destination: str | None, after: str | None = None
    ) -> list[dict[str, Any]]:
        found = []
        for f in self.db.flights.values():
            status = f.dates.get(day)
            if (
                status is not None
                and status.status == "available"
                and (origin is None or f.origin == origin)
                and (destination is None or f.destination == destination)
                and (after is None or f.scheduled_departure_time_est >= after)
            ):
                found.append(
                    {
                        "flight_number": f.flight_number,
                        "origin": f.origin,
                        "destination": f.destination,
                        "date": day,
                        "scheduled_departure_time_est": f.scheduled_departure_time_est,
                        "scheduled_arrival_time_est": f.scheduled_arrival_time_est,
                        "available_seats": status.available_seats,
                        "prices": status.prices,
                    }
                )
        return found

    def search_direct_flight(self, origin: str, destination: str, date: str) -> list[dict]:
        """Bookable direct flights between two airports on a date.

        Args:
            origin: the origin airport's three-letter code, such as 'JFK'.
            destination: the destination airport's three-letter code, such as 'LAX'.
            date: the date, YYYY-MM-DD.
        """
        return self._direct(date, origin, destination)

    def search_onestop_flight(self, origin: str, destination: str, date: str) -> list[list]:
        """Bookable connections with one stop: pairs of flights, the second leaving after the
        first lands (the next day when the first lands after midnight).

        Args:
            origin: the origin airport's three-letter code, such as 'JFK'.
            destination: the destination airport's three-letter code, such as 'LAX'.
            date: the date of the first flight, YYYY-MM-DD.
        """
        pairs = []
        for first in self._direct(date, origin, None):
            arrival = first["scheduled_arrival_time_est"]
            day, after = date, arrival
            if arrival.endswith("+1"):  # lands after midnight
                day = str(dt.date.fromisoformat(date) + dt.timedelta(days=1))
                after = arrival[:-2]
            pairs += [
                [first, second]
                for second in self._direct(day, first["destination"], destination, after)
            ]
        return pairs

    def get_flight_status(self, flight_number: str, date: str) -> str:
        """The status of a flight on a date: available, delayed, on time, flying, landed or
        cancelled.

        Args:
            flight_number: the flight number, such as 'HAT001'.
            date: the date, YYYY-MM-DD.
        """
        return self._flight_date(flight_number, date).status

    # ---- write tools -----------------------------------------------------------------------
    def book_reservation(
        self,
        user_id: str,
        origin: str,
        destination: str,
        flight_type: Literal["one_way", "round_trip"],
        cabin: CabinClass,
        flights: list[FlightInfo],
        passengers: list[Passenger],
        payment_methods: list[PaymentSpec],
        total_baggages: int,
        nonfree_baggages: int,
        insurance: Literal["yes", "no"],
    ) -> Reservation:
        """Book a reservation. The payments must add up to the total exactly: each flight's
        price in the cabin times the passengers, plus insurance and non-free bags.

        Args:
            user_id: the id of the user who books, such as 'sara_doe_496'.
            origin: the trip's origin airport code.
            destination: the trip's destination airport code.
            flight_type: 'one_way' or 'round_trip'.
            cabin: 'basic_economy', 'economy' or 'business' (all flights).
            flights: every flight of the trip, each {flight_number, date}.
            passengers: each {first_name, last_name, dob}.
            payment_methods: each {payment_id, amount}: what to take from which method.
            total_baggages: checked bags in all.
            nonfree_baggages: checked bags beyond the free allowance (paid).
            insurance: 'yes' or 'no' (travel insurance, per passenger).
        """
        user = self._user(user_id)
        _check_cabin(cabin)
        legs = _itinerary(flights)
        people = [Passenger.model_validate(p) for p in passengers]
        pays = [PaymentSpec.model_validate(p) for p in payment_methods]
        if not people or len(people) > MAX_PASSENGERS:
            raise ToolError(f"a booking needs 1 to {MAX_PASSENGERS} passengers")
        if not 0 <= nonfree_baggages <= total_baggages:
            raise ToolError("nonfree_baggages must be between 0 and total_baggages")
        new_id = next((i for i in NEW_RESERVATION_IDS if i not in self.db.reservations), None)
        if new_id is None:
            raise ToolError("too many new reservations in one conversation")
        booked, statuses, total = [], [], 0
        for leg in legs:
            booked_leg, status = self._book_leg(leg, cabin, len(people))
            booked.append(booked_leg)
            statuses.append(status)
            total += booked_leg.price * len(people)
        total += INSURANCE_FEE * len(people) * (insurance == "yes") + BAG_FEE * nonfree_baggages
        self._check_payments(user, pays)
        paid = sum(p.amount for p in pays)
        if paid != total:
            raise ToolError(f"the payments add up to {paid} but the total price is {total}")
        reservation = Reservation(  # validates flight_type and insurance before any change
            reservation_id=new_id,
            user_id=user_id,
            origin=origin,
            destination=destination,
            flight_type=flight_type,
            cabin=cabin,
            flights=booked,
            passengers=people,
            payment_history=[Payment(payment_id=p.payment_id, amount=p.amount) for p in pays],
            created_at=NOW,
            total_baggages=total_baggages,
            nonfree_baggages=nonfree_baggages,
            insurance=insurance,
        )
        for pay in pays:  # every check passed: now change the database
            method = user.payment_methods[pay.payment_id]
            if isinstance(method, GiftCard):
                method.amount -= pay.amount
            elif isinstance(method, Certificate):
                del user.payment_methods[pay.payment_id]
        for status in statuses:
            assert status.available_seats is not None
            status.available_seats[cabin] -= len(people)
        self.db.reservations[new_id] = reservation
        user.reservations.append(new_id)
        return reservation

    def cancel_reservation(self, reservation_id: str) -> Reservation:
        """Cancel a whole reservation: every payment is refunded to its method (gift cards
        at once; certificates are not refunded) and the seats are released. A reservation
        with a flight already flown cannot be cancelled.

        Args:
            reservation_id: the reservation id, such as 'ZFA04Y'.
        """
        res = self._reservation(reservation_id)
        if res.status == "cancelled":
            raise ToolError(f"reservation {reservation_id} is already cancelled")
        for leg in res.flights:
            status = self._flight_date(leg.flight_number, leg.date)
            if status.status in FLOWN:
                raise ToolError(f"flight {leg.flight_number} on {leg.date} has already departed")
        user = self._user(res.user_id)
        refunds = []
        for pay in res.payment_history:
            method = user.payment_methods.get(pay.payment_id)
            if isinstance(method, Certificate) or pay.payment_id.startswith("certificate"):
                continue  # certificates are not refunded
            if isinstance(method, GiftCard):
                method.amount += pay.amount
            refunds.append(Payment(payment_id=pay.payment_id, amount=-pay.amount))
        res.payment_history += refunds
        res.status = "cancelled"
        for leg in res.flights:
            self._release(leg, res.cabin, len(res.passengers))
        return res

    def _release(self, leg: ReservationFlight, cabin: str, seats: int) -> None:
        status = self.db.flights[leg.flight_number].dates.get(leg.date)
        if status is not None and status.available_seats is not None:
            status.available_seats[cabin] = status.available_seats.get(cabin, 0) + seats

    def update_reservation_baggages(
        self, reservation_id: str, total_baggages: int, nonfree_baggages: int, payment_id: str
    ) -> Reservation:
        """Add checked bags to a reservation (bags cannot be removed). Each added non-free
        bag costs 50, taken from ``payment_id`` (a credit card or gift card).

        Args:
            reservation_id: the reservation id.
            total_baggages: the new total of checked bags.
            nonfree_baggages: the new number of paid bags.
            payment_id: the payment method to charge, such as 'credit_card_7815826'.
        """
        res = self._open_reservation(reservation_id)
        if total_baggages < res.total_baggages or nonfree_baggages < res.nonfree_baggages:
            raise ToolError("checked bags cannot be removed from a reservation")
        if nonfree_baggages > total_baggages:
            raise ToolError("nonfree_baggages cannot exceed total_baggages")
        extra = BAG_FEE * (nonfree_baggages - res.nonfree_baggages)
        payment = self._charge(self._user(res.user_id), payment_id, extra)
        if payment is not None:
            res.payment_history.append(payment)
        res.total_baggages, res.nonfree_baggages = total_baggages, nonfree_baggages
        return res

    def update_reservation_flights(
        self, reservation_id: str, cabin: CabinClass, flights: list[FlightInfo], payment_id: str
    ) -> Reservation:
        """Change the flights and/or cabin of a reservation. ``flights`` is the WHOLE new
        itinerary (unchanged flights too). The price difference is charged to, or refunded
        to, ``payment_id`` (a credit card or gift card).

        Args:
            reservation_id: the reservation id.
            cabin: the cabin for every flight after the change.
            flights: every flight of the new itinerary, each {flight_number, date}.
            payment_id: the payment method for the difference.
        """
        res = self._open_reservation(reservation_id)
        _check_cabin(cabin)
        legs = _itinerary(flights)
        seats = len(res.passengers)
        kept = {(f.flight_number, f.date): f for f in res.flights} if cabin == res.cabin else {}
        new_flights, new_statuses, total = [], [], 0
        for leg in legs:
            if (leg.flight_number, leg.date) in kept:
                same = kept[(leg.flight_number, leg.date)]
                new_flights.append(same)
                total += same.price * seats
                continue
            booked_leg, status = self._book_leg(leg, cabin, seats)
            new_flights.append(booked_leg)
            new_statuses.append(status)
            total += booked_leg.price * seats
        difference = total - sum(f.price for f in res.flights) * seats
        payment = self._charge(self._user(res.user_id), payment_id, difference)
        if payment is not None:
            res.payment_history.append(payment)
        staying = {(f.flight_number, f.date) for f in new_flights} if cabin == res.cabin else set()
        for old in res.flights:
            if (old.flight_number, old.date) not in staying:
                self._release(old, res.cabin, seats)
        for status in new_statuses:
            assert status.available_seats is not None
            status.available_seats[cabin] -= seats
        res.flights, res.cabin = new_flights, cabin
        return res

    def update_reservation_passengers(
        self, reservation_id: str, passengers: list[Passenger]
    ) -> Reservation:
        """Replace the passengers' details (the number of passengers cannot change).

        Args:
            reservation_id: the reservation id.
            passengers: every passenger, each {first_name, last_name, dob}, in order.
        """
        res = self._open_reservation(reservation_id)
        people = [Passenger.model_validate(p) for p in passengers]
        if len(people) != len(res.passengers):
            raise ToolError(
                f"the reservation has {len(res.passengers)} passengers; {len(people)} given"
            )
        res.passengers = people
        return res

    def send_certificate(self, user_id: str, amount: int) -> str:
        """Give a user a travel certificate (compensation) worth ``amount``. Only when the
        policy allows it.

        Args:
            user_id: the user's id.
            amount: the certificate's value.
        """
        user = self._user(user_id)
        if amount <= 0:
            raise ToolError("a certificate's amount must be positive")
        for number in NEW_CERTIFICATE_NUMBERS:
            cid = f"certificate_{number}"
            if cid not in user.payment_methods:
                user.payment_methods[cid] = Certificate(source="certificate", id=cid, amount=amount)
                return f"certificate {cid} worth {amount} added to user {user_id}"
        raise ToolError("too many certificates in one conversation")

    # ---- generic tools -----------------------------------------------------------------------
    def calculate(self, expression: str) -> str:
        """Evaluate arithmetic: numbers, + - * / and parentheses, such as '(180 + 30) * 2'.

        Args:
            expression: the expression.
        """
        try:
            return str(round(float(_arithmetic(ast.parse(expression, mode="eval"))), 2))
        except (SyntaxError, ZeroDivisionError, OverflowError) as e:
            raise ToolError(f"cannot calculate {expression!r:.80}: {e}") from None

    def transfer_to_human_agents(self, summary: str) -> str:
        """Hand the customer to a human agent, with a summary of their issue. Only when they
        ask for one, or the request cannot be handled under the policy with these tools.

        Args:
            summary: the customer's issue in a few sentences.
        """
        return "Transfer successful"


def db_copy(db: FlightDB) -> FlightDB:
    """A deep copy of ``db`` (tools change the database they are given)."""
    return db.model_copy(deep=True)
