"""The CPU kernels (kernels/cpu_attention.c, kernels/cpu_linear.c, kernels/cpu_norm.c, kernels/cpu_act.c,
kernels/cpu_rotary.c, kernels/cpu_argmax.c), compiled for this machine on first use into one library and loaded
with ctypes.

Plain C with no torch headers, so a build takes about a second; the shared library is kept under
`$PAGEDSERVE_CACHE_DIR` (default `~/.cache/pagedserve`), named by a hash of the sources, the flags and the
CPU's features, and built to a temporary name then renamed, so workers starting together neither rebuild
it nor load half a file. A build also removes the libraries of other sources unused for a week (one per
upgrade or edit would pile up). With no C compiler (or a failed build) `load()` returns None, logs why once, and
the CPU attention keeps its torch path, bfloat16 linears oneDNN or float32 chunks for MKL, RMSNorm, the MLP's
activation, the rotary embedding and greedy sampling torch's.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
SOURCES = (HERE / "cpu_attention.c", HERE / "cpu_linear.c", HERE / "cpu_norm.c", HERE / "cpu_act.c",
           HERE / "cpu_rotary.c", HERE / "cpu_argmax.c", HERE / "cpu_mask.c")
HEADERS = (HERE / "bf16.h", HERE / "silu.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=gnu11", "-fno-math-errno")
STALE_S = 7 * 24 * 3600
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}  # the kernels' `dtype` argument, where they take one
LINEAR_WAYS = {"fma": 0, "amx": 1, "avx512bf16": 2}  # bf16_linear's `way` (cpu_linear.c: WAY_FMA, WAY_AMX, WAY_DP)


def _cpu_features() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    return next((line for line in text.splitlines() if line.startswith(("flags", "Features"))), "")


def _cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE_DIR") or Path.home() / ".cache" / "pagedserve")


def _build(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so")
    os.close(fd)
    try:
        subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp, "-lm"], check=True, capture_output=True,
                       text=True)
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    _remove_stale(target)


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


@functools.cache
def load() -> ctypes.CDLL | None:
    """The kernel library with its entry points typed (`paged_attention`, `bf16_linear` and `f32_linear` with their
    packing, `bf16_rms_norm`, `bf16_silu_mul`, `bf16_rotary`, `rows_argmax`, `rows_mask_bits`), or None when it cannot be built here
    (logged)."""
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.warning("no C compiler (cc, gcc or $CC): the CPU attention gathers keys and values with torch, and "
                    "bfloat16 linears widen their weights in chunks for MKL, instead")
        return None
    texts = [f.read_text() for f in SOURCES + HEADERS]
    key = hashlib.sha256("\0".join([*texts, compiler, *FLAGS, _cpu_features()]).encode()).hexdigest()
    target = _cache_dir() / f"cpu_kernels-{key[:16]}.so"
    try:
        os.utime(target)  # marks it used, for _remove_stale
    except OSError:
        pass  # not built yet, or a read-only cache directory
    try:
        if not target.exists():
            started = time.monotonic()
            log.info("compiling the CPU kernels into %s (once for these sources, flags and CPU)", target)
            _build(compiler, target)
            log.info("compiled the CPU kernels in %.1f s", time.monotonic() - started)
        lib = ctypes.CDLL(str(target))
    except (OSError, subprocess.CalledProcessError) as e:  # a build failed, or another checkout removed it
        detail = getattr(e, "stderr", "") or e
        log.warning("building or loading the CPU kernels failed (%s): the CPU attention and bfloat16 linears use "
                    "torch", str(detail).strip()[-500:])
        return None
    lib.paged_attention.restype = ctypes.c_int
    lib.paged_attention.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _I64, _I64, _PTR, _I64, _PTR,
                                    _I64, _I64, _I64, _I64, _I64, ctypes.c_float, ctypes.c_int]
    lib.bf16_linear.restype = ctypes.c_int
    lib.bf16_linear.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int, ctypes.c_int,
                                ctypes.c_int]
    lib.bf16_amx.restype = ctypes.c_int
    lib.bf16_amx.argtypes = []
    lib.bf16_dp.restype = ctypes.c_int
    lib.bf16_dp.argtypes = []
    lib.packed_size.restype = _I64
    lib.packed_size.argtypes = [_I64, _I64, ctypes.c_int]
    lib.bf16_pack.restype = None
    lib.bf16_pack.argtypes = [_PTR, _I64, _I64, _PTR, ctypes.c_int]
    lib.bf16_unpack_rows.restype = ctypes.c_int
    lib.bf16_unpack_rows.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR, ctypes.c_int]
    lib.f32_linear_preferred.restype = ctypes.c_int
    lib.f32_linear_preferred.argtypes = []
    lib.f32_linear.restype = ctypes.c_int
    lib.f32_linear.argtypes = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _I64, _I64, ctypes.c_int]
    lib.f32_pack.restype = None
    lib.f32_pack.argtypes = [_PTR, _I64, _I64, _PTR]
    lib.f32_unpack_rows.restype = ctypes.c_int
    lib.f32_unpack_rows.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _PTR]
    lib.bf16_rms_norm.restype = None
    lib.bf16_rms_norm.argtypes = [_PTR, _I64, _PTR, _PTR, _I64, _I64, ctypes.c_float]
    lib.bf16_silu_mul_vectorized.restype = ctypes.c_int
    lib.bf16_silu_mul_vectorized.argtypes = []
    lib.bf16_silu_mul.restype = None
    lib.bf16_silu_mul.argtypes = [_PTR, _I64, _PTR, _I64, _I64]
    lib.bf16_rotary_vectorized.restype = ctypes.c_int
    lib.bf16_rotary_vectorized.argtypes = []
    lib.bf16_rotary.restype = ctypes.c_int
    lib.bf16_rotary.argtypes = [_PTR, _I64, _I64, _I64, _PTR, _PTR, _I64, _PTR, _I64]
    lib.rows_argmax.restype = ctypes.c_int
    lib.rows_argmax.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR]
    lib.rows_mask_bits.restype = ctypes.c_int
    lib.rows_mask_bits.argtypes = [ctypes.c_int, _PTR, _I64, _I64, _I64, _PTR, _PTR, _I64]
    return lib
