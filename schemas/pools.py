"""Worker pools by prompt length: a fleet split into pools, each serving the prompts of
one range of lengths from its own job topics in its own consumer group, so each pool is
sized and scaled (on its own lag) for its jobs, and a burst of very long prompts does not
sit in front of short chats ("route extremely long requests separately").

Declared once, in the same form for workers, the gateway and the client:

    pools:
      - {name: default, max_prompt_tokens: 8192}
      - {name: long, max_prompt_tokens: 131072}

Pools are listed by increasing `max_prompt_tokens`; a pool serves prompts of more tokens
than the pool before it and at most its own bound (the first from 1; the last may have
no bound). The pool `default` must exist: it keeps the job topics of a deployment without
pools, `<prefix>.jobs.<priority>`, and the `kafka.group_id`, so producers that do not
count tokens write to it and its workers forward what is not theirs; another pool `P`
reads `<prefix>.jobs.<P>.<priority>` in the group `<group_id>.<P>` (or its own `group_id`).
Without a `pools` section there is one pool, `default`, without a bound: nothing routes.

No torch, no worker code: the client and the gateway import this.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

DEFAULT_POOL = "default"
POOL_NAME_PATTERN = r"^[a-z0-9][a-z0-9_-]{0,31}$"  # one segment of a topic name


class Pool(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One pool of workers.

    Attributes:
        name: 1-32 characters of `a-z 0-9 _ -` (a segment of its topics' names).
        max_prompt_tokens: the longest prompt it serves, in tokens (None: no bound; only
            the last pool).
        group_id: its consumer group (None: derived, see the module docstring).
    """

    name: str
    max_prompt_tokens: int | None = None
    group_id: str | None = None


class Pools:
    """The declared pools, validated, with the routing rule.

    Raises (construction):
        ValueError: a name that is not 1-32 characters of `a-z 0-9 _ -` (starting with a
            letter or digit), a name twice, no pool `default`, bounds not increasing, a
            bound below 1, or an unbounded pool that is not the last. The message names
            the pool.
    """

    def __init__(self, pools: Sequence[Pool] = ()) -> None:
        pools = list(pools) or [Pool(name=DEFAULT_POOL)]
        seen: set[str] = set()
        last: int | None = 0
        for i, p in enumerate(pools):
            if not re.fullmatch(POOL_NAME_PATTERN, p.name):
                raise ValueError(f"pool name {p.name!r} must be 1-32 characters of a-z 0-9 _ - "
                                 "(starting with a letter or digit)")
            if p.name in seen:
                raise ValueError(f"pool {p.name!r} is declared twice")
            seen.add(p.name)
            if last is None:
                raise ValueError(f"pool {pools[i - 1].name!r} has no max_prompt_tokens, so it must be the last; "
                                 f"{p.name!r} follows it")
            if p.max_prompt_tokens is not None:
                if p.max_prompt_tokens < 1:
                    raise ValueError(f"pool {p.name!r}: max_prompt_tokens must be >= 1, got {p.max_prompt_tokens}")
                if p.max_prompt_tokens <= last:
                    raise ValueError(f"pools must be listed by increasing max_prompt_tokens: {p.name!r} has "
                                     f"{p.max_prompt_tokens}, the pool before it {last}")
            last = p.max_prompt_tokens
        if DEFAULT_POOL not in seen:
            raise ValueError(f"the pools must include one named {DEFAULT_POOL!r} (the topics producers that do "
                             f"not count tokens write to); got {[p.name for p in pools]}")
        self.pools: tuple[Pool, ...] = tuple(pools)
        self._by_name = {p.name: p for p in pools}

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.pools]

    @property
    def routes(self) -> bool:
        """More than one pool, or one with a bound: prompt lengths decide where a job runs."""
        return len(self.pools) > 1 or self.pools[0].max_prompt_tokens is not None

    def get(self, name: str) -> Pool:
        """Raises ValueError (naming the declared pools) for an unknown name."""
        pool = self._by_name.get(name)
        if pool is None:
            raise ValueError(f"unknown pool {name!r}; the declared pools are {self.names}")
        return pool

    def min_prompt_tokens(self, pool: Pool) -> int:
        """The shortest prompt `pool` serves (1 for the first pool)."""
        i = self.pools.index(pool)
        return 1 if i == 0 else self.pools[i - 1].max_prompt_tokens + 1

    def holds(self, pool: Pool, num_prompt_tokens: int) -> bool:
        return (num_prompt_tokens >= self.min_prompt_tokens(pool)
                and (pool.max_prompt_tokens is None or num_prompt_tokens <= pool.max_prompt_tokens))

    def route(self, num_prompt_tokens: int) -> Pool | None:
        """The pool serving a prompt of `num_prompt_tokens`; None when it is longer than
        every pool's bound."""
        for pool in self.pools:
            if pool.max_prompt_tokens is None or num_prompt_tokens <= pool.max_prompt_tokens:
                return pool
        return None

    @property
    def max_prompt_tokens(self) -> int | None:
        """The longest prompt any pool serves (None: no bound)."""
        return self.pools[-1].max_prompt_tokens

    def group_id(self, pool: Pool, base: str) -> str:
        """The consumer group of `pool`'s workers; `base` is `kafka.group_id`."""
        if pool.group_id is not None:
            return pool.group_id
        return base if pool.name == DEFAULT_POOL else f"{base}.{pool.name}"


def topic_segment(pool: str | None) -> str:
    """The part of a job topic's name that names the pool: "" for the default pool."""
    return "" if pool is None or pool == DEFAULT_POOL else f"{pool}."
