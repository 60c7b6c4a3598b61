"""Who may do what: API keys (`Authorization: Bearer <key>`) mapped to a tenant and the
highest priority class each may use.

Keys are held only as SHA-256 digests and looked up by digest, so no comparison leaks a
key's prefix through timing and a key file may hold digests instead of keys. 401 for a
missing or unknown key, 403 for a priority above the key's grant.
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

from schemas import keys
from worker.gateway.config import ApiKey, GatewayConfig
from worker.gateway.errors import ApiError


class Grant(NamedTuple):
    """What one key may do: run jobs as `tenant` (None: no tenant) at `max_priority` or
    below, on the base model and `adapters`. `name` labels it in logs."""

    tenant: str | None
    max_priority: str
    name: str | None = None
    adapters: frozenset[str] | None = None  # the LoRA adapters it may use; None: all

    def may_use(self, adapter: str) -> bool:
        return self.adapters is None or adapter in self.adapters


def rank(priority: str) -> int:
    """0 for `high`, 1 `normal`, 2 `low` (lower ranks first)."""
    return keys.PRIORITIES.index(priority)


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyRing:
    """The API keys of one gateway process (read once at start).

    Args:
        entries: keys with their grants (`GatewayConfig.load_keys()`).
        anonymous: the grant of requests without a key, or None (then they get 401).
    """

    def __init__(self, entries: list[ApiKey], anonymous: Grant | None = None) -> None:
        self._grants: dict[str, Grant] = {}
        for e in entries:
            self._grants[e.key_sha256 or digest(e.key or "")] = Grant(
                e.tenant, e.max_priority, e.name, None if e.adapters is None else frozenset(e.adapters))
        self.anonymous = anonymous

    @classmethod
    def from_config(cls, cfg: GatewayConfig) -> KeyRing:
        """Raises ConfigError: unreadable key file, or no key at all without `allow_anonymous`."""
        from worker.config import ConfigError

        entries = cfg.load_keys()
        if not entries and not cfg.allow_anonymous:
            raise ConfigError("gateway.api_keys / gateway.api_keys_file: no API key configured (set "
                              "gateway.allow_anonymous: true to serve without keys, for development only)")
        anonymous = Grant(None, cfg.default_priority, "anonymous") if cfg.allow_anonymous else None
        return cls(entries, anonymous)

    def __len__(self) -> int:
        return len(self._grants)

    def authenticate(self, authorization: str | None) -> Grant:
        """The grant of an `Authorization` header value.

        Raises:
            ApiError: 401 (missing, malformed or unknown key).
        """
        if not authorization:
            if self.anonymous is not None:
                return self.anonymous
            raise ApiError(401, "You didn't provide an API key. Provide it in the Authorization header "
                           "(Authorization: Bearer YOUR_KEY).", code="missing_api_key")
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "Malformed Authorization header; expected 'Bearer YOUR_KEY'.", code="invalid_api_key")
        grant = self._grants.get(digest(token))
        if grant is None:
            raise ApiError(401, "Incorrect API key provided.", code="invalid_api_key")
        return grant


def effective_priority(grant: Grant, requested: str | None, default: str) -> str:
    """The priority a request runs at: the one it asked for, else `default` capped by the
    key's grant.

    Raises:
        ApiError: 403 when `requested` is above the grant; 400 when it is not a class.
    """
    if requested is None:
        return default if rank(default) >= rank(grant.max_priority) else grant.max_priority
    if requested not in keys.PRIORITIES:
        raise ApiError(400, f"priority must be one of {list(keys.PRIORITIES)}, got {requested!r}", param="priority",
                       code="invalid_value")
    if rank(requested) < rank(grant.max_priority):
        raise ApiError(403, f"this API key may use priority '{grant.max_priority}' at most, not '{requested}'",
                       param="priority", code="priority_not_allowed")
    return requested
