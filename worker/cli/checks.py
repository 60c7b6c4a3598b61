"""The outcome type of `inflight check` (`preflight.py`, `model_checks.py`) and its
message helpers."""

from __future__ import annotations

from typing import Literal

import msgspec

Status = Literal["pass", "fail", "skip", "info"]


class Check(msgspec.Struct, frozen=True):
    """The outcome of one check. `setting` is the config field to fix when it fails."""

    name: str
    status: Status
    setting: str
    detail: str


def short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
