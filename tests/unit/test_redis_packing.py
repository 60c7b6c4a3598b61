"""The worker's Redis connections pack commands with hiredis: byte for byte what redis-py's
own packer sends, multi-word command names included."""

from __future__ import annotations

import redis.asyncio as aioredis

from worker.security.redis import _connection_class, _FastConnection


def test_hiredis_packing_equals_redis_py():
    fast, plain = _FastConnection(), aioredis.Connection()
    cases = [
        ("SCRIPT LOAD", "return 1"),
        ("EVALSHA", "a" * 40, 2, "inflight:job:j:log", "inflight:job:j", "t", b'{"seq":1}', 7, 1.5),
        ("SET", "k", b"\x00\xffbinary", "EX", 60),
        (b"CONFIG GET", "appendonly"),
    ]
    for args in cases:
        assert b"".join(fast.pack_command(*args)) == b"".join(plain.pack_command(*args)), args


def test_connection_class_by_url():
    assert _connection_class("redis://h:6379/0")["connection_class"].__name__ == "_FastConnection"
    assert _connection_class("rediss://h:6379/0")["connection_class"].__name__ == "_FastSSLConnection"
    assert _connection_class("unix:///tmp/redis.sock") == {}
