"""Building and loading the CPU kernels written in C (`cpu_decode.c`, `cpu_woq.c`).

A source is compiled at first use with the machine's C compiler (`$CC`, else `cc` / `gcc`;
`-O3 -march=native`, a fraction of a second) into `$XDG_CACHE_HOME/inflight/kernels`
(default `~/.cache/inflight/kernels`), named by a hash of the source, the compiler's
version, the flags and the CPU's feature flags, and loaded with ctypes (calls release the
GIL). The file is moved into place atomically, so engines building at once never load half
of one. Without a compiler, or when the build fails, `build` returns the reason and the
callers use their torch path.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

CFLAGS = ("-O3", "-march=native", "-shared", "-fPIC")


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "inflight" / "kernels"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | str:
    """The loaded library built from `source` with `CFLAGS + extra_flags`, or why it could
    not be built or loaded (a string: the compiler missing, its error's first 500
    characters, an OS error)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler (cc / gcc, or $CC) on PATH"
    flags = (*CFLAGS, *extra_flags)
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source.read_text(), version, " ".join(flags), _cpu_flags(),
                                        platform.machine()]).encode()).hexdigest()[:16]
        target = cache_dir() / f"{source.stem}-{key}.so"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                proc = subprocess.run([cc, *flags, "-o", str(built), str(source), "-lm"], capture_output=True,
                                      text=True, timeout=120)
                if proc.returncode != 0:
                    return f"{cc} failed: {(proc.stderr or proc.stdout).strip()[:500]}"
                os.replace(built, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
