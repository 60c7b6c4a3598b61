"""Compare the running interpreter's installed distributions with requirements.lock.

Used by tools/setup_venv.sh (any difference: sync .venv to the lock) and by
tests/repo/test_lock.py. Reads only; installs nothing. Stdlib + `packaging` (locked, so
present in a synced venv; in an empty one its absence itself means "not synced").

    python tools/lockcheck.py [requirements.lock] [--quiet]    exit 0: equal, 1: differs
"""

from __future__ import annotations

import re
import sys
import sysconfig
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

DEFAULT_LOCK = Path(__file__).resolve().parents[1] / "requirements.lock"
PROJECT = "inflight-worker"  # installed beside the lock (editable), required
# Installed beside the lock on purpose: the project itself and the venv's own pip.
ALLOWED_EXTRA = frozenset({PROJECT, "pip"})
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;]+)\s*(?:;\s*(.+?))?\s*$")


@dataclass(frozen=True, slots=True)
class Pin:
    name: str  # normalized (PEP 503): lower case, runs of -_. as one -
    version: str
    marker: str | None  # PEP 508 environment marker, None = every platform


def normalize(name: str) -> str:
    """PEP 503 name: `PyYAML` and `pyyaml`, `typing_extensions` and `typing-extensions` agree."""
    return re.sub(r"[-_.]+", "-", name).lower()


def read_lock(path: Path | str = DEFAULT_LOCK) -> list[Pin]:
    """The `name==version [; marker]` lines of a uv/pip-compile requirements file
    (comments, `# via` annotations and options skipped).

    Raises:
        ValueError: a requirement line that is not an exact `==` pin (names the line).
    """
    pins = []
    for n, raw in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith(("#", "-")):
            continue
        m = _PIN.match(line)
        if m is None:
            raise ValueError(f"{path}:{n}: not an exact pin (name==version): {raw!r}")
        pins.append(Pin(normalize(m[1]), m[2], m[3]))
    return pins


def applies(pin: Pin) -> bool:
    """True if the pin's marker holds for this interpreter and platform."""
    if pin.marker is None:
        return True
    from packaging.markers import Marker

    return Marker(pin.marker).evaluate()


def site_dirs() -> list[str]:
    """The environment's install directories (purelib, platlib): where pip and uv put
    distributions. Not `sys.path`, which a running process may have grown: importing
    setuptools (as torch.compile's C++ builder does) appends its `_vendor` folder, whose
    vendored `packaging`, `jaraco.*`, `wheel`... would read as installed."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def installed() -> dict[str, str]:
    """Normalized name -> version of every distribution installed in this interpreter's
    environment (`site_dirs`), whatever the process has imported or added to sys.path."""
    dists = metadata.distributions(path=site_dirs())
    return {normalize(d.metadata["Name"]): d.version for d in dists if d.metadata["Name"]}


def differences(pins: list[Pin], have: dict[str, str] | None = None,
                allowed_extra: frozenset[str] = ALLOWED_EXTRA, required: tuple[str, ...] = ()) -> list[str]:
    """One line per difference between the pins that apply here and `have` (default:
    what is installed): missing, other version, or installed but not locked (except
    `allowed_extra`); and each of `required` not installed. Empty when the environment
    equals the lock."""
    have = installed() if have is None else have
    wanted = {p.name: p.version for p in pins if applies(p)}
    locked_anywhere = {p.name for p in pins}
    out = []
    for name, version in sorted(wanted.items()):
        got = have.get(name)
        if got is None:
            out.append(f"{name}: locked {version}, not installed")
        elif got != version:
            out.append(f"{name}: locked {version}, installed {got}")
    for name in sorted(set(have) - set(wanted) - allowed_extra):
        why = "its marker excludes this platform" if name in locked_anywhere else "not in the lock"
        out.append(f"{name}: installed {have[name]}, {why}")
    out.extend(f"{name}: not installed" for name in required if name not in have)
    return out


def main(argv: list[str]) -> int:
    quiet = "--quiet" in argv
    args = [a for a in argv if a != "--quiet"]
    lock = Path(args[0]) if args else DEFAULT_LOCK
    try:
        diff = differences(read_lock(lock), required=(PROJECT,))
    except ImportError as e:  # an empty venv has no `packaging` yet
        diff = [f"cannot evaluate markers: {e}"]
    if not quiet:
        for line in diff:
            print(line, file=sys.stderr)
        if not diff:
            print(f"installed packages equal {lock}", file=sys.stderr)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
