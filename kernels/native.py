"""The CPU kernels (kernels/cpu_attention.c, kernels/cpu_linear.c, kernels/cpu_norm.c, kernels/cpu_act.c,
kernels/cpu_rotary.c, kernels/cpu_argmax.c, kernels/cpu_mask.c), compiled on first use into one library per
instruction set and loaded with ctypes.

Their ABI is kernels/cpu_kernels.h: every source includes it (the compiler refuses a definition that differs) and
`load` types each entry point from its prototype there, so a signature is written once. On x86-64 the sources are
built for each of `ISAS` (from the x86-64-v2 baseline up to AMX), each level adding -m flags (and tuned for this
CPU, which chooses no instruction), and `load` takes the highest whose features /proc/cpuinfo lists: every `#if`
path compiles on any x86-64 machine (and in CI), and runs where the CPU has it. Elsewhere one build for the
machine (-march=native).

Plain C with no torch headers, so a build takes seconds; the shared library is kept under
`$PAGEDSERVE_CACHE_DIR` (default `~/.cache/pagedserve`), named by a hash of the sources, the flags and the
CPU's features, and built to a temporary name then renamed, so workers starting together neither rebuild
it nor load half a file. A build also removes the libraries of other sources unused for a week (one per
upgrade or edit would pile up). With no C compiler (or a failed build) `load()` returns None and logs why once;
gpu_worker/cpu_paths.py, which chooses every CPU path of a worker, then takes torch's.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_attention.c", HERE / "cpu_linear.c", HERE / "cpu_norm.c", HERE / "cpu_act.c",
           HERE / "cpu_rotary.c", HERE / "cpu_argmax.c", HERE / "cpu_mask.c")
ABI = HERE / "cpu_kernels.h"
HEADERS = (ABI, HERE / "bf16.h", HERE / "silu.h")
# -ffp-contract=fast: a * b + c fused where the ISA has FMA, gcc's default for GNU C, said here so that another
# compiler (clang's default is "on") does not round differently. -Werror=missing-prototypes: an entry point not in
# the ABI header does not build.
FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-fno-math-errno", "-ffp-contract=fast",
         "-Werror=missing-prototypes")
STALE_S = 7 * 24 * 3600
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' `dtype` argument, where they take one
LINEAR_WAYS = {"fma": 0, "amx": 1, "avx512bf16": 2}  # bf16_linear's `way` (cpu_linear.c: WAY_FMA, WAY_AMX, WAY_DP)
AUTO = "auto"


@dataclass(frozen=True)
class Isa:
    """An instruction set the kernels are built for: the compiler's flags, and the /proc/cpuinfo features a CPU
    needs to run the build."""
    name: str
    flags: tuple[str, ...]
    features: frozenset[str] = frozenset()

    def above(self, name: str, flags: tuple[str, ...], features: tuple[str, ...]) -> Isa:
        return Isa(name, self.flags + flags, self.features | frozenset(features))


def _x86_isas() -> tuple[Isa, ...]:
    v2 = Isa("x86-64-v2", ("-march=x86-64-v2", "-mtune=native"))
    avx2 = v2.above("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"))
    avx512 = avx2.above("avx512", ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"),
                        ("avx512f", "avx512bw", "avx512dq", "avx512vl"))
    avx512bf16 = avx512.above("avx512bf16", ("-mavx512bf16",), ("avx512_bf16",))
    amx = avx512bf16.above("amx", ("-mamx-tile", "-mamx-bf16"), ("amx_tile", "amx_bf16"))
    return v2, avx2, avx512, avx512bf16, amx


# lowest first: `load` takes the last one the CPU supports
ISAS = _x86_isas() if platform.machine().lower() in ("x86_64", "amd64") else (Isa("native", ("-march=native",)),)


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def supported_isas() -> list[str]:
    """The builds this CPU can run, lowest first."""
    features = set(_cpu_features().partition(":")[2].split())
    return [isa.name for isa in ISAS if isa.features <= features]


def isa_named(name: str) -> Isa:
    """`name`'s build, "auto" the highest this CPU runs; ValueError for one it does not know or this CPU cannot run."""
    supported = supported_isas()
    if name == AUTO:
        name = supported[-1]
    if name not in supported:
        known = ", ".join(isa.name for isa in ISAS)
        raise ValueError(f"the CPU kernels' instruction set {name!r} is not one this CPU runs "
                         f"({', '.join(supported)}; builds: {known})")
    return next(isa for isa in ISAS if isa.name == name)


_CTYPES = {"void": None, "int": ctypes.c_int, "int64_t": ctypes.c_int64, "float": ctypes.c_float}


@dataclass(frozen=True)
class Prototype:
    name: str
    restype: type | None
    argtypes: tuple[type, ...]


def _ctype(declaration: str) -> type | None:
    """A parameter's or a return's ctypes type: any pointer a void pointer, else one of `_CTYPES`."""
    if "*" in declaration:
        return ctypes.c_void_p
    words = declaration.replace("const", " ").split()
    type_name = words[0] if words else "void"
    if type_name not in _CTYPES or len(words) > 2:
        raise ValueError(f"cpu_kernels.h: no ctypes type for {declaration.strip()!r}")
    return _CTYPES[type_name]


def prototypes(header: str) -> list[Prototype]:
    """The function prototypes of the ABI header, in order."""
    text = re.sub(r"/\*.*?\*/", " ", header, flags=re.S)
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    found = []
    for restype, name, params in re.findall(r"([\w\s]+?[\s*]+)(\w+)\s*\(([^)]*)\)\s*;", text):
        params = [p for p in params.split(",") if p.strip() != "void"]
        found.append(Prototype(name, _ctype(restype), tuple(_ctype(p) for p in params)))
    return found


def _cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve")


def _build(compiler: str, flags: list[str], target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _remove_stale(target)


def build_flags(isa: Isa) -> list[str]:
    """The compiler's flags for `isa`'s build: with `$PAGEDSERVE_SANITIZE` (e.g. "address,undefined", for CI's
    sanitizer run) the sanitizers too, and any error they find ends the process."""
    sanitizers = os.environ.get("PAGEDSERVE_SANITIZE", "")
    checks = [f"-fsanitize={sanitizers}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer"] if sanitizers else []
    return [*FLAGS, *isa.flags, *checks]


def _remove_stale(target: Path) -> None:
    """Other builds not touched for a week. A week, not at once: another checkout sharing the directory may be
    about to load its own (and Linux keeps a loaded library mapped after it is removed)."""
    now = time.time()
    for old in target.parent.glob("cpu_kernels-*.so"):
        try:
            if old != target and now - old.stat().st_mtime > STALE_S:
                old.unlink()
        except OSError:
            pass  # removed by another process meanwhile


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def build(isa: Isa, cc: str) -> Path:
    """The shared library of `isa`'s build, compiled by `cc` unless the cache holds it; OSError or
    CalledProcessError when it cannot be built. Builds an instruction set this CPU cannot run too (CI compiles
    every one)."""
    flags = build_flags(isa)
    texts = [f.read_text() for f in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, cc, *flags, _cpu_features()]).encode()).hexdigest()
    target = _cache_dir() / f"cpu_kernels-{isa.name}-{key[:16]}.so"
    try:
        os.utime(target)  # marks it used, for _remove_stale
    except OSError:
        pass  # not built yet, or a read-only cache directory
    if not target.exists():
        started = time.monotonic()
        log.info("compiling the CPU kernels for %s into %s (once for these sources, flags and CPU)", isa.name, target)
        _build(cc, flags, target)
        log.info("compiled the CPU kernels in %.1f s", time.monotonic() - started)
    return target


@functools.cache
def load(isa: str = AUTO) -> ctypes.CDLL | None:
    """The kernel library built for `isa` (`ISAS`' names; "auto": the highest this CPU runs), every entry point of
    cpu_kernels.h typed, or None when it cannot be built here (logged). ValueError for an instruction set this CPU
    cannot run."""
    chosen = isa_named(isa)
    cc = compiler()
    if cc is None:
        log.warning("no C compiler (cc, gcc or $CC): the CPU attention gathers keys and values with torch, and "
                    "bfloat16 linears widen their weights in chunks for MKL, instead")
        return None
    try:
        lib = ctypes.CDLL(str(build(chosen, cc)))
    except (OSError, subprocess.CalledProcessError) as e:  # a build failed, or another checkout removed it
        detail = getattr(e, "stderr", "") or e
        log.warning("building or loading the CPU kernels failed (%s): the CPU attention and bfloat16 linears use "
                    "torch", str(detail).strip()[-500:])
        return None
    for proto in prototypes(ABI.read_text()):
        function = getattr(lib, proto.name)
        function.restype, function.argtypes = proto.restype, list(proto.argtypes)
    return lib
