"""Reading a job's events: the text and token events of its last attempt (an attempt
after a `restarted` event replaces what the earlier one streamed)."""

from __future__ import annotations

from schemas.wire import Event, Restarted, Token


def last_attempt_tokens(events: list[Event]) -> list[Token]:
    """The `token` events of the last attempt (a `restarted` drops those before it)."""
    tokens: list[Token] = []
    for ev in events:
        if isinstance(ev, Restarted):
            tokens = []
        elif isinstance(ev, Token):
            tokens.append(ev)
    return tokens


def text_of(events: list[Event]) -> str:
    """Concatenate the token text of the last attempt."""
    return "".join(t.text for t in last_attempt_tokens(events))
