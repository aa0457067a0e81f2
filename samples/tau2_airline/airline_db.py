"""The generated airline domain's data (or any data in tau2's layout, read for our own
tools): typed models of the database and the tasks, and a loader of tau2's on-disk format.
tau2's own domain is read by tau2's package instead (``tau2_domain``).

The layout under a data directory (one that ``generate_domain.py`` writes, or tau2-bench's
``data`` directory)::

    tau2/domains/airline/db.json            {"flights", "users", "reservations"}
    tau2/domains/airline/tasks.json         [{"id", "user_scenario", "evaluation_criteria", ...}]
    tau2/domains/airline/policy.md          the assistant's policy
    tau2/domains/airline/split_tasks.json   {"train": [ids], "test": [ids]}
    tau2/user_simulator/simulation_guidelines.md

Models accept fields they do not name (kept, and hashed with the rest), so newer tau2 data
loads; what the tools and the evaluator use is typed.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DOMAIN_DIR = Path("tau2") / "domains" / "airline"
GUIDELINES_PATH = Path("tau2") / "user_simulator" / "simulation_guidelines.md"

CabinClass = Literal["basic_economy", "economy", "business"]
CABINS: tuple[str, ...] = ("basic_economy", "economy", "business")


class Record(BaseModel):
    """A database record: unknown fields are kept as given."""

    model_config = ConfigDict(extra="allow")


class Name(Record):
    first_name: str
    last_name: str


class Passenger(Record):
    first_name: str
    last_name: str
    dob: str


class CreditCard(Record):
    source: Literal["credit_card"]
    id: str
    brand: str = ""
    last_four: str = ""


class GiftCard(Record):
    source: Literal["gift_card"]
    id: str
    amount: float


class Certificate(Record):
    source: Literal["certificate"]
    id: str
    amount: float


PaymentMethod = Annotated[CreditCard | GiftCard | Certificate, Field(discriminator="source")]


class Payment(Record):
    """One entry of a reservation's payment history (negative: a refund)."""

    payment_id: str
    amount: int


class FlightDate(Record):
    """A flight on one date: ``available`` (with seats and prices per cabin), ``delayed``,
    ``on time``, ``flying``, ``landed`` or ``cancelled`` (times ride along as extra fields)."""

    status: str
    available_seats: dict[str, int] | None = None
    prices: dict[str, int] | None = None


class Flight(Record):
    flight_number: str
    origin: str
    destination: str
    scheduled_departure_time_est: str
    scheduled_arrival_time_est: str
    dates: dict[str, FlightDate]


class User(Record):
    user_id: str
    name: Name
    address: dict[str, Any] = {}
    email: str = ""
    dob: str = ""
    membership: Literal["regular", "silver", "gold"] = "regular"
    payment_methods: dict[str, PaymentMethod] = {}
    saved_passengers: list[Passenger] = []
    reservations: list[str] = []


class ReservationFlight(Record):
    origin: str
    destination: str
    flight_number: str
    date: str
    price: int


class Reservation(Record):
    reservation_id: str
    user_id: str
    origin: str
    destination: str
    flight_type: Literal["one_way", "round_trip"]
    cabin: CabinClass
    flights: list[ReservationFlight]
    passengers: list[Passenger]
    payment_history: list[Payment]
    created_at: str
    total_baggages: int
    nonfree_baggages: int
    insurance: Literal["yes", "no"]
    status: Literal["cancelled"] | None = None


class FlightDB(Record):
    """The whole database. :meth:`digest` is what the evaluator compares."""

    flights: dict[str, Flight]
    users: dict[str, User]
    reservations: dict[str, Reservation]

    def digest(self) -> str:
        """A SHA-256 of the database's canonical JSON (sorted keys, no unset optionals)."""
        data = self.model_dump(mode="json", exclude_none=True)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


# ---- tasks -------------------------------------------------------------------------------


class Action(Record):
    """A gold tool call: ``name(**arguments)``; ``compare_args`` names the arguments that
    must match when actions are compared (None: all)."""

    action_id: str = ""
    name: str
    arguments: dict[str, Any] = {}
    compare_args: list[str] | None = None


class EvaluationCriteria(Record):
    actions: list[Action] = []
    communicate_info: list[str] = []
    nl_assertions: list[str] = []
    reward_basis: list[str] = ["DB", "COMMUNICATE"]


class UserInstructions(Record):
    """What the simulated customer knows and wants (tau2's structured instructions)."""

    domain: str = "airline"
    reason_for_call: str
    known_info: str | None = None
    unknown_info: str | None = None
    task_instructions: str = ""


class UserScenario(Record):
    persona: str | None = None
    instructions: UserInstructions | str

    def text(self) -> str:
        """The scenario as the user simulator's prompt shows it."""
        parts = [f"Persona: {self.persona}"] if self.persona else []
        ins = self.instructions
        if isinstance(ins, str):
            return "\n".join([*parts, ins])
        parts.append(f"Reason for the call: {ins.reason_for_call}")
        if ins.known_info:
            parts.append(f"What you know: {ins.known_info}")
        if ins.unknown_info:
            parts.append(f"What you do not know: {ins.unknown_info}")
        if ins.task_instructions:
            parts.append(f"How to behave: {ins.task_instructions}")
        return "\n".join(parts)


class AirlineTask(Record):
    id: str
    description: Any = None
    user_scenario: UserScenario
    initial_state: dict[str, Any] | None = None
    evaluation_criteria: EvaluationCriteria = Field(default_factory=EvaluationCriteria)


# ---- the domain on disk ----------------------------------------------------------------------


@dataclass
class Domain:
    """Everything a run needs: the database, the tasks by id, the split, and the two prompts."""

    db: FlightDB
    tasks: dict[str, AirlineTask]
    split: dict[str, list[str]]
    policy: str
    guidelines: str

    def task_ids(self, split: str) -> list[str]:
        """The ids of a split (``train``, ``test``, or ``base``: every task, as tau2 names
        it), in the split file's order."""
        if split == "base":
            return list(self.tasks)
        if split not in self.split:
            raise DomainDataError(
                f"no split {split!r}: the data has {sorted(self.split)} (or 'base': every task)"
            )
        return [i for i in self.split[split] if i in self.tasks]


class DomainDataError(ValueError):
    """The data directory is missing a file or holds data this sample cannot read."""


def _read_json(path: Path) -> Any:
    if not path.exists():
        raise DomainDataError(f"{path} is missing: is this a tau2 data directory?")
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise DomainDataError(f"{path} is not valid JSON: {e}") from None


def _validated(model: type[BaseModel], data: Any, where: Path) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise DomainDataError(f"{where}: not airline data this sample can read: {e}") from None


def load_domain(root: str | Path) -> Domain:
    """Read the airline domain under ``root``, the directory holding ``tau2/``.

    Left out, with a warning naming them: tasks with an ``initial_state`` (this sample starts
    every episode from ``db.json``) and tasks with nothing but an LLM judge to score them
    (``NL_ASSERTION`` only). Tasks whose gold actions these tools refuse are kept, with a
    warning: their gold end state is then the refused one.
    """
    from airline_tools import AirlineTools, db_copy  # the tools import these models

    base = Path(root).expanduser().resolve()
    domain = base / DOMAIN_DIR
    if not domain.is_dir() and base.name == "airline":
        raise DomainDataError(f"{base} is the airline folder: give the directory holding tau2/")
    db = _validated(FlightDB, _read_json(domain / "db.json"), domain / "db.json")
    tasks: dict[str, AirlineTask] = {}
    left_out: dict[str, list[str]] = {
        "with an initial_state": [],
        "that only an LLM judge can score": [],
    }
    refused = []
    for raw in _read_json(domain / "tasks.json"):
        task = _validated(AirlineTask, raw, domain / "tasks.json")
        basis = set(task.evaluation_criteria.reward_basis)
        if task.initial_state:
            left_out["with an initial_state"].append(task.id)
        elif not basis & {"DB", "COMMUNICATE", "ACTION"}:
            left_out["that only an LLM judge can score"].append(task.id)
        else:
            tasks[task.id] = task
            tools = AirlineTools(db_copy(db))
            for action in task.evaluation_criteria.actions:
                tools.execute(action.name, action.arguments)
            if any(c.error for c in tools.calls):
                refused.append(task.id)
    for why, ids in left_out.items():
        if ids:
            warnings.warn(f"left out {len(ids)} task(s) {why}: {', '.join(ids)}", stacklevel=2)
    if refused:
        warnings.warn(
            f"{len(refused)} task(s) have gold actions these tools refuse: {', '.join(refused)}",
            stacklevel=2,
        )
    split_path = domain / "split_tasks.json"
    split = _read_json(split_path) if split_path.exists() else {"train": list(tasks), "test": []}
    guidelines_path = base / GUIDELINES_PATH
    return Domain(
        db=db,
        tasks=tasks,
        split={k: [str(i) for i in v] for k, v in split.items()},
        policy=(domain / "policy.md").read_text() if (domain / "policy.md").exists() else "",
        guidelines=guidelines_path.read_text() if guidelines_path.exists() else "",
    )


@lru_cache(maxsize=4)
def cached_domain(root: str) -> Domain:
    """:func:`load_domain`, read once per process (rollouts copy ``db`` before changing it)."""
    return load_domain(root)


def write_domain(domain: Domain, root: str | Path) -> Path:
    """Write ``domain`` under ``root`` in tau2's layout; returns ``root``."""
    base = Path(root)
    directory = base / DOMAIN_DIR
    directory.mkdir(parents=True, exist_ok=True)
    db = domain.db.model_dump(mode="json", exclude_none=True)
    (directory / "db.json").write_text(json.dumps(db, indent=1))
    tasks = [t.model_dump(mode="json", exclude_none=True) for t in domain.tasks.values()]
    (directory / "tasks.json").write_text(json.dumps(tasks, indent=1))
    (directory / "split_tasks.json").write_text(json.dumps(domain.split, indent=1))
    (directory / "policy.md").write_text(domain.policy)
    (base / GUIDELINES_PATH).parent.mkdir(parents=True, exist_ok=True)
    (base / GUIDELINES_PATH).write_text(domain.guidelines)
    return base
