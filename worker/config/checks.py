"""Validation helpers shared by every config section, and the secret readers.

Owns `ConfigError` (raised by every section's `__post_init__`, with the field named)
and the rules common to sections: positive counts, closed vocabularies, settings that
would be silently ignored, secrets given once (value or `*_file`), TLS file sets.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field."""


def positive(section: str, **fields: int | None) -> None:
    for name, value in fields.items():
        if value is not None and value < 1:
            raise ConfigError(f"{section}.{name} must be >= 1, got {value}")


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")  # the standard library's names


def one_of(section: str, name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{section}.{name} must be one of {sorted(allowed)}, got {value!r}")


def unused(section: str, why: str, **fields: object) -> None:
    """Settings that would be silently ignored are errors (secrets excepted: a platform
    may inject them into every environment)."""
    for name, value in fields.items():
        if value is not None:
            raise ConfigError(f"{section}.{name} is set but unused with {why}")


def one_secret(section: str, name: str, value: str | None, path: str | None) -> None:
    if value is not None and path is not None:
        raise ConfigError(f"{section}.{name} and {section}.{name}_file are both set; set one")


def tls_fields(section: str, uses_tls: bool, why: str, cfg: object) -> None:
    """Checks the ssl_* fields common to the kafka and redis sections."""
    names = ("ssl_cafile", "ssl_certfile", "ssl_keyfile")  # secrets may be injected everywhere: not checked
    if not uses_tls:
        unused(section, why, **{n: getattr(cfg, n) for n in names})
        return
    one_secret(section, "ssl_key_password", cfg.ssl_key_password, cfg.ssl_key_password_file)
    if cfg.ssl_keyfile is not None and cfg.ssl_certfile is None:
        raise ConfigError(f"{section}.ssl_keyfile is set without {section}.ssl_certfile (the client certificate)")
    if (cfg.ssl_key_password is not None or cfg.ssl_key_password_file is not None) and cfg.ssl_certfile is None:
        raise ConfigError(f"{section}.ssl_key_password is set without {section}.ssl_certfile (the client certificate)")


def read_secret(field: str, value: str | None, path: str | None) -> str | None:
    """A secret from its file (the first line, without the line break) or its value.

    Args:
        field: `<section>.<name>` for the error message (the file field is `<field>_file`).

    Raises:
        ConfigError: the file cannot be read; the message names `<field>_file` and the
            path, never the content.
    """
    if path is None:
        return value
    try:
        with open(path, encoding="utf-8") as f:
            return f.readline().rstrip("\r\n")
    except OSError as e:
        raise ConfigError(f"{field}_file: cannot read {path!r} ({e.strerror})") from None


def redact_url(url: str) -> str:
    """`url` with its password (if any) replaced by `***` (a netloc of several hosts, as
    a Sentinel URL's, too)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, path = rest.partition("/")
    creds, at, hosts = netloc.rpartition("@")
    if not at or ":" not in creds:
        return url
    return f"{scheme}://{creds.split(':', 1)[0]}:***@{hosts}{slash}{path}"
