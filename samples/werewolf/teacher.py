"""A scripted teacher for every werewolf seat, served like a hosted model by VoltRL's teacher
server (:mod:`voltrl.serving.teacher`), so ``Trainer.dev`` records its games through the real
AgentScope agents and the gateway, as a student's would be, for a warm start (SFT) before RL.

The teacher sees only what a model sees: the request's messages (the system prompt with the
rules, the player's role, the other werewolves and the pinned note; the history AgentScope's
multi-agent formatter renders as ``<history>`` blocks: the moderator's prompts and news, the
ballots, the speeches) and its tools. A choice is AgentScope's structured output: the schema
of ``agent.reply(..., structured_schema=...)`` arrives as the ``GenerateStructuredOutput``
function tool, whose ``target`` enum lists the legal answers; the teacher calls that tool with
one of them (AgentScope validates the arguments and ends the reply), so every recorded choice
is legal by construction. A speech (no tools) is one short sentence others can parse.

How it plays (``rng``, seeded by the request, breaks ties where nothing else decides, so a
re-run records the same games):

- the werewolves' talk: the first wolf to speak proposes a victim (``Let us kill PlayerN.``): a
  player who claimed to be the seer, else one of the village at random; every other wolf
  repeats the first proposal heard that night; the last to speak says they agree when the
  round named one victim, and they all vote for it (never for a werewolf);
- the seer checks players she has not checked (at random); she says what she found by day
  (``I am the seer. Player2 is a villager. Player4 is a werewolf. I suspect Player4.``) once
  she knows a werewolf still alive, or when she is the most accused so far, and in her last
  words;
- the witch saves the victim when she is asked (the first night, unless she is the victim)
  and poisons a werewolf the seer revealed, else nobody;
- by day (speech and vote) the village names a werewolf the seer revealed, else the most
  suspected player (:func:`suspicion`: each accusation today, ``I suspect PlayerN.``, and
  each time a player named someone known innocent: the cleared, the seer, oneself; a tie: the
  first accused today, else one at random), never one known innocent; a werewolf reasons the
  same way on what is public and never names one of the pack;
- the hunter shoots a revealed werewolf, else the most suspected player, else nobody;
- last words repeat the speaker's suspicion (the seer's: her checks).

:func:`policy` is the teacher server's policy (``voltrl teacher serve
samples/werewolf/teacher.py:policy``); :func:`teacher_reply` the samples' form
(``python samples/teacher_server.py werewolf``); ``run.py dev --teacher`` serves it and seats
every player there. :func:`read_view` is the parsing, :func:`choose` and :func:`speak` the
play.
"""

from __future__ import annotations

import random
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

TOOL = "GenerateStructuredOutput"
"""The name of AgentScope's structured-output tool."""

SPEAKER = re.compile(r"^([A-Za-z][\w-]*): (.*)$")
"""A history line: the speaker (``moderator`` or a player), then what was said."""
SUSPECT = re.compile(r"\bI suspect (\w+)")
PROPOSAL = re.compile(r"\bLet us kill (\w+)")
CLAIM = re.compile(r"\b(\w+) is (an? \w+|not a werewolf)\b")
NIGHT_OR_DAY = re.compile(r"\b(Night|Day) (\d+)\b")


@dataclass
class View:
    """What one request shows a player: who they are, what they were told, what is asked."""

    me: str
    role: str
    pack: list[str]
    """The other werewolves (a werewolf's system prompt names them; empty for the village)."""
    players: list[str]
    """Every seat (``Player1`` .. ``PlayerN``, from the system prompt's player count)."""
    note: list[str]
    """The pinned note's lines (``Night 1: you checked Player4: a werewolf.``)."""
    lines: list[tuple[str, str]]
    """The history, oldest first: ``(speaker, text)``, ``moderator`` for the moderator."""
    choices: list[str] | None
    """The legal answers of a choice (the tool's ``target`` enum); None for a speech."""
    tool: str = TOOL
    prompt: str = field(init=False)
    """The moderator's question this request answers (the last thing the moderator said)."""

    def __post_init__(self) -> None:
        self.prompt = next((t for s, t in reversed(self.lines) if s == "moderator"), "")

    @property
    def wolf(self) -> bool:
        """Whether the player is a werewolf."""
        return self.role == "werewolf"

    @property
    def when(self) -> tuple[str, int] | None:
        """The prompt's ``("Night" | "Day", n)``, if it names one."""
        m = NIGHT_OR_DAY.search(self.prompt)
        return (m.group(1), int(m.group(2))) if m else None


def _text(content: Any) -> str:
    """A message's text: a string, or its text parts joined."""
    if isinstance(content, list):
        return "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def history_lines(messages: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """The ``(speaker, text)`` lines of the request's ``<history>`` blocks, oldest first (a
    line that names no speaker continues the one before)."""
    lines: list[tuple[str, str]] = []
    for message in messages:
        if message.get("role") != "user":
            continue
        text = _text(message.get("content"))
        for block in re.findall(r"<history>\n?(.*?)\n?</history>", text, flags=re.S):
            for line in block.splitlines():
                if m := SPEAKER.match(line):
                    lines.append((m.group(1), m.group(2).strip()))
                elif lines and line.strip():
                    lines[-1] = (lines[-1][0], f"{lines[-1][1]} {line.strip()}")
    return lines


def read_view(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> View:
    """The player's view of a chat-completions request (its ``messages`` and ``tools``)."""
    system = next((_text(m.get("content")) for m in messages if m.get("role") == "system"), "")
    me = _find(r"You are (\w+);", system)
    role = _find(r"your role is (\w+)\.", system)
    mates = _find(r"The other werewolves are ([^.\n]*)\.", system)
    pack = [x.strip() for x in mates.split(",") if x.strip()]
    _, pinned, rest = system.partition("\nWhat you know:\n")
    note = [x.removeprefix("- ") for x in rest.splitlines()] if pinned else []
    count = int(_find(r"with (\d+) players", system) or 0)
    stem = re.sub(r"\d+$", "", me)
    players = [f"{stem}{i}" for i in range(1, count + 1)] if stem != me else [me]
    choices, tool = None, TOOL
    for t in tools or ():
        function = t.get("function", t)
        target = (function.get("parameters") or {}).get("properties", {}).get("target", {})
        if "enum" in target or "const" in target:  # pydantic writes one choice as a const
            legal = target.get("enum", [target.get("const")])
            choices, tool = [str(x) for x in legal], function["name"]
    lines = history_lines(messages)
    return View(me, role, pack, players, note, lines, choices, tool)


def _find(pattern: str, text: str) -> str:
    m = re.search(pattern, text)
    return m.group(1) if m else ""


# --- what a player knows -------------------------------------------------------------------


def dead(view: View) -> set[str]:
    """The players the history says died: at night, voted out, or shot."""
    out: set[str] = set()
    for speaker, text in view.lines:
        if speaker != "moderator":
            continue
        for m in re.finditer(r"Died last night: ([^.]*)\.|The hunter shot ([^.]*)\.", text):
            out.update(x.strip() for x in (m.group(1) or m.group(2)).split(","))
        out.update(re.findall(r"(\w+) is eliminated\.", text))
    return out - {"nobody"}


def alive(view: View) -> list[str]:
    """The players not known to be dead, in seat order (the player included)."""
    gone = dead(view)
    return [p for p in view.players if p not in gone]


def my_checks(view: View) -> dict[str, bool]:
    """The seer's checks from her note: player → whether a werewolf."""
    found = re.findall(r"you checked (\w+): (.*)\.$", "\n".join(view.note), flags=re.M)
    return {name: verdict == "a werewolf" for name, verdict in found}


def seer_claims(view: View) -> dict[str, bool]:
    """What the first player to claim the seer said of others: player → whether a werewolf
    (the seer herself trusts her note; a werewolf knows better)."""
    claimer = None
    claims: dict[str, bool] = {}
    for speaker, text in view.lines:
        if speaker == "moderator" or "I am the seer" not in text:
            continue
        claimer = claimer or speaker
        if speaker == claimer:
            for name, verdict in CLAIM.findall(text.split("I am the seer", 1)[1]):
                claims[name] = verdict == "a werewolf"
    return claims


def claimed_seer(view: View) -> str | None:
    """The first player who said ``I am the seer``."""
    return next((s for s, t in view.lines if s != "moderator" and "I am the seer" in t), None)


def public_facts(view: View) -> dict[str, bool]:
    """What everyone heard: the first claimed seer's verdicts, and that she is no werewolf."""
    facts = seer_claims(view)
    if (seer := claimed_seer(view)) is not None:
        facts.setdefault(seer, False)
    return facts


def known(view: View) -> dict[str, bool]:
    """Who the player takes for a werewolf (True) or not (False): a werewolf knows the
    pack; the seer her checks; the rest of the village the public facts (and the witch the
    victim she saved); everyone knows themselves."""
    if view.wolf:
        return {p: p in view.pack or p == view.me for p in view.players}
    facts = my_checks(view) if view.role == "seer" else public_facts(view)
    for name in re.findall(r"you saved (\w+)\.", "\n".join(view.note)):
        facts.setdefault(name, False)
    facts[view.me] = False
    return facts


def today(view: View) -> list[tuple[str, str]]:
    """The history since the last day began (``Day N.``), or all of it before the first."""
    starts = [i for i, (s, t) in enumerate(view.lines) if s == "moderator" and _day_start(t)]
    return view.lines[starts[-1] :] if starts else view.lines


def _day_start(text: str) -> bool:
    return re.match(r"Day \d+\. ", text) is not None


def accused(view: View) -> Counter[str]:
    """Today's accusations (``I suspect X``), counted in the order each name was first
    accused."""
    return Counter(
        name
        for speaker, text in today(view)
        if speaker != "moderator"
        for name in SUSPECT.findall(text)
    )


def _most_accused(view: View, candidates: list[str]) -> str | None:
    """The most accused of ``candidates`` today (a tie: the first accused), if any is."""
    counts = [(name, n) for name, n in accused(view).items() if name in candidates]
    if not counts:
        return None
    top = max(n for _, n in counts)
    return next(name for name, n in counts if n == top)


# --- the play ------------------------------------------------------------------------------


def acts(view: View) -> list[tuple[str, str]]:
    """Every ``(player, named)`` the history shows: accusations (``I suspect X``) and day
    ballots (``A -> B``), oldest first."""
    out: list[tuple[str, str]] = []
    for speaker, text in view.lines:
        if speaker != "moderator":
            out += [(speaker, name) for name in SUSPECT.findall(text)]
        elif re.match(r"Day \d+: The votes: ", text):
            out += re.findall(r"(\w+) -> (\w+)", text)
    return out


def suspicion(view: View, facts: dict[str, bool]) -> Counter[str]:
    """Suspicion of each player given ``facts`` (player → werewolf or not): an accusation
    today counts 1; naming a player known not to be a werewolf 2 each time; naming a known
    werewolf -1; being named by a known werewolf -2."""
    score = Counter(accused(view))
    for player, named in acts(view):
        if facts.get(named) is False:
            score[player] += 2
        elif facts.get(named):
            score[player] -= 1
        if facts.get(player):
            score[named] -= 2
    return score


def suspect(view: View, candidates: list[str], rng: random.Random) -> str:
    """Whom the player names by day among ``candidates`` (never empty): a known werewolf,
    else the most suspected of the rest (:func:`suspicion`; a tie: the first accused today,
    else one at random), never one known innocent while another may be named. A werewolf
    reasons as the village would on what is public, and never names one of the pack."""
    if view.wolf:
        pack = {view.me, *view.pack}
        candidates = [c for c in candidates if c not in pack] or candidates
        facts = public_facts(view)
    else:
        facts = known(view)
        wolves = [c for c in candidates if facts.get(c)]
        if wolves:
            return wolves[0]
    open_ = [c for c in candidates if facts.get(c) is not False] or candidates
    score = suspicion(view, facts)
    top = max(score[c] for c in open_)
    tied = [c for c in open_ if score[c] == top]
    return _most_accused(view, tied) or rng.choice(tied)


def night_target(view: View, candidates: list[str], rng: random.Random) -> str:
    """The werewolves' victim: the first proposal heard tonight, else a claimed seer, else one
    of the village at random (never a werewolf while another may be named)."""
    pack = {view.me, *view.pack}
    village = [c for c in candidates if c not in pack] or candidates
    for speaker, text in tonight(view):
        for name in PROPOSAL.findall(text) if speaker in pack else ():
            if name in village:
                return name
    seer = claimed_seer(view)
    return seer if seer in village else rng.choice(village)


def agreed(view: View) -> bool:
    """Whether the werewolves' last round of talk tonight named one victim (each alive
    werewolf speaks once a round)."""
    gone = dead(view)
    pack = {view.me, *view.pack}
    n = len([p for p in pack if p not in gone])
    proposals = [
        name
        for speaker, text in tonight(view)
        if speaker in pack
        for name in PROPOSAL.findall(text)
    ]
    return len(set(proposals[-n:])) <= 1


def tonight(view: View) -> list[tuple[str, str]]:
    """The history of the prompt's night so far: after the last thing the moderator said of
    anything else (empty when the prompt names no night)."""
    if not view.when or view.when[0] != "Night":
        return []
    night = f"Night {view.when[1]}"
    for i in range(len(view.lines) - 1, -1, -1):
        speaker, text = view.lines[i]
        if speaker == "moderator" and not text.startswith(night):
            return view.lines[i + 1 :]
    return view.lines


def _others(view: View) -> list[str]:
    return [p for p in alive(view) if p != view.me]


def speak(view: View, rng: random.Random) -> str:
    """The player's speech: the werewolves' talk, the day's speech, or last words."""
    others = _others(view) or view.players
    if "werewolves' talk" in view.prompt:
        return f"Let us kill {night_target(view, others, rng)}."
    checks = my_checks(view) if view.role == "seer" else {}
    last_words = "last words" in view.prompt
    live_wolves = [p for p, wolf in checks.items() if wolf and p in others]
    pressed = _most_accused(view, view.players) == view.me
    if checks and (last_words or live_wolves or pressed):
        told = " ".join(f"{p} is {_verdict(view, p)}." for p in checks)
        name = live_wolves[0] if live_wolves else suspect(view, others, rng)
        return f"I am the seer. {told} I suspect {name}."
    return f"I suspect {suspect(view, others, rng)}."


def _verdict(view: View, name: str) -> str:
    """The seer's verdict on ``name`` as her note words it (``a werewolf``, ``a villager``)."""
    m = re.search(rf"you checked {re.escape(name)}: (.*)\.$", "\n".join(view.note), flags=re.M)
    return m.group(1) if m else "unknown"


def choose(view: View, rng: random.Random) -> tuple[str, str]:
    """The player's answer to a choice (one of ``view.choices``) and a short reason."""
    options = list(view.choices or ())
    prompt = view.prompt
    named = [c for c in options if c in view.players]
    if "do the werewolves agree" in prompt:
        if agreed(view):
            return _pick(options, "agree", "talk on"), "we named the same victim"
        return _pick(options, "talk on", "agree"), "we named different victims"
    if "vote whom to kill" in prompt:
        return night_target(view, named or options, rng), "the pack's choice"
    if "healing potion" in prompt:
        return _pick(options, "save", "pass"), "save the victim"
    if "poison someone" in prompt:
        wolves = [c for c in named if known(view).get(c)]
        if wolves:
            return wolves[0], "a revealed werewolf"
        return _pick(options, "nobody"), "no werewolf revealed"
    if "whom do you check" in prompt:
        checked = my_checks(view)
        fresh = [c for c in named if c not in checked] or named or options
        return rng.choice(fresh), "not checked yet"
    if "shoot someone" in prompt:
        wolves = [c for c in named if known(view).get(c)]
        if wolves:
            return wolves[0], "a revealed werewolf"
        facts, score = known(view), suspicion(view, known(view))
        open_ = [c for c in named if facts.get(c) is not False]
        top = max((score[c] for c in open_), default=0)
        if top > 0:
            tied = [c for c in open_ if score[c] == top]
            return _most_accused(view, tied) or rng.choice(tied), "the most suspected"
        return _pick(options, "nobody"), "no suspect"
    if "vote to eliminate" in prompt:
        return suspect(view, named or options, rng), "my suspicion"
    return rng.choice(options), "a guess"


def _pick(options: list[str], *preferred: str) -> str:
    """The first of ``preferred`` among ``options``, else the first option."""
    return next((p for p in preferred if p in options), options[0])


def policy(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]], *, rng: random.Random
) -> str | dict[str, Any]:
    """The teacher server's policy: a speech (text) or a call of the structured-output tool
    with a legal ``target``."""
    view = read_view(messages, tools)
    if view.choices is None:
        return speak(view, rng)
    target, reason = choose(view, rng)
    return {"name": view.tool, "arguments": {"target": target, "reason": reason}}


def teacher_reply(request: dict[str, Any], rng: random.Random) -> dict[str, Any]:
    """The samples' form (``samples/teacher_server.py werewolf``): the assistant message for a
    chat-completions request body."""
    reply = policy(request["messages"], request.get("tools") or [], rng=rng)
    if isinstance(reply, str):
        return {"content": reply}
    return {"content": None, "tool_calls": [reply]}
