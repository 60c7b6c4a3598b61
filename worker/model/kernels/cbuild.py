"""Building and loading the CPU kernels written in C (`cpu_decode.c`, `cpu_woq.c`,
`cpu_lora.c`) and the torch operators written in C++ (`native_ops.cpp`).

A source is compiled at first use with the machine's compiler (C: `$CC`, else `cc` /
`gcc`, `-O3 -march=native`, a fraction of a second; C++: `$CXX`, else `c++` / `g++`,
against the installed torch's headers and libraries, a few seconds) into
`$XDG_CACHE_HOME/inflight/kernels` (default `~/.cache/inflight/kernels`), named by a hash
of the source, the compiler's version, the flags, the CPU's feature flags and (C++) the
torch version. The file is moved into place atomically, so engines building at once never
load half of one. A C library is loaded with ctypes (calls release the GIL); an operator
library with `torch.ops.load_library` by its caller. Without a compiler, or when the build
fails, the build returns the reason and the callers use their torch path.
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


def _cpuinfo(*prefixes: str) -> str:
    """`/proc/cpuinfo`'s first line starting with each prefix group, joined by newlines (a
    group's absent line is empty); the platform's processor name where it cannot be read."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    return "\n".join(next((ln for ln in lines if ln.startswith(p)), "") for p in prefixes)


def _cpu_flags() -> str:
    return _cpuinfo(("flags", "Features")) or platform.processor()


def cpu_identity() -> str:
    """The CPU's model name and feature flags (`/proc/cpuinfo`'s first), or the platform's
    processor name where those cannot be read: what a timing made on this CPU holds for."""
    return _cpuinfo("model name", ("flags", "Features"))


def build(source: Path, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | str:
    """The loaded library built from `source` with `CFLAGS + extra_flags`, or why it could
    not be built or loaded (a string: the compiler missing, its error's first 500
    characters, an OS error)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return "no C compiler (cc / gcc, or $CC) on PATH"
    target = _compiled(cc, source, (*CFLAGS, *extra_flags), ("-lm",), "")
    if isinstance(target, str):
        return target
    try:
        return ctypes.CDLL(str(target))
    except OSError as e:
        return f"{type(e).__name__}: {e}"


def build_torch_ops(source: Path) -> Path | str:
    """The shared library of torch operators built from the C++ `source` against the
    installed torch (to load with `torch.ops.load_library`), or why it could not be built
    (a string, as `build`'s)."""
    import torch
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cxx is None:
        return "no C++ compiler (c++ / g++, or $CXX) on PATH"
    lib_dirs = cpp_extension.library_paths()
    flags = ("-O2", "-std=c++20", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{d}" for d in cpp_extension.include_paths()), *(f"-L{d}" for d in lib_dirs),
             *(f"-Wl,-rpath,{d}" for d in lib_dirs))
    return _compiled(cxx, source, flags, ("-lc10", "-ltorch_cpu"), torch.__version__)


def _compiled(compiler: str, source: Path, flags: tuple[str, ...], libs: tuple[str, ...], extra_key: str) -> Path | str:
    """The cached build of `source` (module docstring), built now if missing; or why not."""
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
        key = hashlib.sha256("\0".join([source.read_text(), version, " ".join(flags), _cpu_flags(),
                                        platform.machine(), extra_key]).encode()).hexdigest()[:16]
        target = cache_dir() / f"{source.stem}-{key}.so"
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                proc = subprocess.run([compiler, *flags, "-o", str(built), str(source), *libs], capture_output=True,
                                      text=True, timeout=300)
                if proc.returncode != 0:
                    return f"{compiler} failed: {(proc.stderr or proc.stdout).strip()[:500]}"
                os.replace(built, target)
        return target
    except (OSError, subprocess.SubprocessError) as e:
        return f"{type(e).__name__}: {e}"
