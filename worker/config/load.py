"""Loading a config: a YAML file plus `INFLIGHT_<SECTION>__<FIELD>` environment
overrides, converted into a root Struct (`WorkerConfig`, or the gateway's own), and the
redacted copy that goes to logs."""

from __future__ import annotations

import msgspec

from worker.config.checks import ConfigError, redact_url
from worker.config.worker import WorkerConfig

ENV_PREFIX = "INFLIGHT_"


SECRET_FIELDS = {"kafka": ("sasl_password", "ssl_key_password"), "redis": ("password", "ssl_key_password")}


def redacted_config(cfg: WorkerConfig) -> dict:
    """The config as plain data for logs, with every secret replaced by `***`
    (`SECRET_FIELDS` and the password in `redis.url`; the `*_file` paths are kept)."""
    data = msgspec.to_builtins(cfg)
    for section, names in SECRET_FIELDS.items():
        for name in names:
            if data[section].get(name) is not None:
                data[section][name] = "***"
    data["redis"]["url"] = redact_url(cfg.redis.url)
    return data


def load_config(path: str | None = None, env: dict[str, str] | None = None, *, root: type = WorkerConfig):
    """Read a YAML file (optional) and apply `INFLIGHT_<SECTION>__<FIELD>` environment
    overrides, e.g. `INFLIGHT_KAFKA__BOOTSTRAP_SERVERS`. A value for a string field is
    taken as is (passwords may hold any character); other fields parse it as a YAML
    scalar (`64`, `0.5`, `true`, `null`, `[a, b]`); an empty value means null.

    `root`: the Struct of the whole file (default `WorkerConfig`; the gateway has its
    own, `worker.gateway.config.GatewayFileConfig`); its fields are the sections.

    Raises:
        ConfigError: unreadable file, unknown section/field, wrong type, invalid value;
            the message names the field.
    """
    import os

    import yaml

    data: dict = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"cannot read config file {path!r}: {e.strerror}") from None
        except yaml.YAMLError as e:  # position only: the text may hold a secret
            mark = getattr(e, "problem_mark", None)
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            raise ConfigError(f"config file {path!r} is not valid YAML{where}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"config file {path!r} must hold a mapping of sections")
    for key, raw in (env if env is not None else os.environ).items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        section, _, field = key[len(ENV_PREFIX) :].lower().partition("__")
        data.setdefault(section, {})
        if not isinstance(data[section], dict):
            raise ConfigError(f"config section {section!r} must be a mapping")
        data[section][field] = _env_value(key, section, field, raw, root)
    try:
        return msgspec.convert(data, root)
    except msgspec.ValidationError as e:
        msg = str(e)
        if msg.startswith(tuple(f"{f.name}." for f in msgspec.structs.fields(root))):
            raise ConfigError(msg.split(" - at ")[0]) from None  # raised by our own checks
        raise ConfigError(f"invalid config: {msg}") from None


def _field_type(section: str, field: str, root: type = WorkerConfig):
    """The annotated type of `<section>.<field>` of `root`, or None if unknown."""
    sections = {f.name: f.type for f in msgspec.structs.fields(root)}
    sect = sections.get(section)
    if sect is None:
        return None
    return {f.name: f.type for f in msgspec.structs.fields(sect)}.get(field)


def _env_value(key: str, section: str, field: str, raw: str, root: type = WorkerConfig):
    import types
    import typing

    import yaml

    if raw == "":
        return None
    typ = _field_type(section, field, root)
    if typ is str or (typing.get_origin(typ) in (typing.Union, types.UnionType)
                      and str in typing.get_args(typ)):
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:  # never echo the value: it may be a secret
        raise ConfigError(f"{section}.{field}: the value of {key} is not a valid scalar") from None
