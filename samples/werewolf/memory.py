"""A player's memory: what the game said, kept under a budget of the model's tokens, and a
pinned private note the budget never drops.

AgentScope keeps an agent's conversation in ``agent.state.context``; before each call the
game drops the oldest messages until the rest fit ``history_tokens`` (counted with the model's
tokenizer, :func:`token_counter`). What a player must not forget (the seer's checks, the
witch's potions, its own votes, the werewolves' victims) is written to its note as well, and
:class:`PinnedNote` appends the note to the system prompt of every call.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from agentscope.middleware import MiddlewareBase

HISTORY_TOKENS = 2_000
"""A player's history budget, in tokens, unless the game row says otherwise."""

CHARS_PER_TOKEN = 4
"""With no tokenizer named (a hosted model), a token is counted as this many characters."""

TokenCount = Callable[[str], int]
"""A text's length in tokens."""


@functools.lru_cache(maxsize=4)
def token_counter(tokenizer: str | None) -> TokenCount:
    """Counts a text's tokens as the model named ``tokenizer`` does (what LocalRL takes:
    ``tiny``, a packaged model, a directory or a cached hub name); None: about
    :data:`CHARS_PER_TOKEN` characters a token. Loaded once per process."""
    if tokenizer is None:
        return lambda text: -(-len(text) // CHARS_PER_TOKEN)
    from voltrl.models.loading import load_tokenizer

    loaded = load_tokenizer(tokenizer)
    return lambda text: len(loaded(text, add_special_tokens=False).input_ids)


def message_text(msg: Any) -> str:
    """What of a message reaches the prompt: its speaker, text, tool calls and results."""
    parts = [str(msg.name or "")]
    for block in msg.content if isinstance(msg.content, list) else [msg.content]:
        if isinstance(block, str):
            parts.append(block)
        elif block.type == "text":
            parts.append(block.text)
        elif block.type == "tool_call":
            parts.append(block.input)
        elif block.type == "tool_result":
            parts.append(block.output if isinstance(block.output, str) else str(block.output))
    return ": ".join(parts)


class History:
    """Keeps players' contexts under a token budget; counts each message once."""

    def __init__(self, count: TokenCount, budget: int = HISTORY_TOKENS) -> None:
        self.count = count
        self.budget = budget
        self._tokens: dict[str, int] = {}
        self.dropped = 0

    def tokens(self, msg: Any) -> int:
        """A message's tokens (remembered by its id)."""
        if (n := self._tokens.get(msg.id)) is None:
            n = self._tokens[msg.id] = self.count(message_text(msg))
        return n

    def trim(self, context: list[Any], budget: int | None = None) -> None:
        """Drop the oldest messages of ``context`` (in place) until the rest fit ``budget``
        tokens (default: the history's); the newest message always stays."""
        budget = self.budget if budget is None else budget
        total = sum(self.tokens(m) for m in context)
        while len(context) > 1 and total > budget:
            total -= self.tokens(context.pop(0))
            self.dropped += 1


class PinnedNote(MiddlewareBase):
    """Appends a player's private note (``note()``'s lines) to its system prompt at every
    call, so trimming the history never loses it."""

    def __init__(self, note: Callable[[], list[str]]) -> None:
        super().__init__()
        self.note = note

    async def on_system_prompt(self, agent: Any, current_prompt: str) -> str:
        """The system prompt, then the note (when it has anything)."""
        lines = self.note()
        if not lines:
            return current_prompt
        return current_prompt + "\nWhat you know:\n" + "\n".join(f"- {x}" for x in lines)
