"""The C kernels' builds (kernels/native.py ISAS) as fixtures: `kernel`, each build this CPU runs in turn, so the
kernel oracle tests check every path the CPU can take (an x86-64-v2 build's scalar loops, AVX2's, AVX-512's, AVX-512
BF16's, AMX's), not only the one a worker here would choose; `avx512_kernel`, those with AVX-512 (where the
kernels that only pay with it run); `best_kernel`, the build a worker here takes."""
from __future__ import annotations

import ctypes

import pytest

from kernels import native


def loaded(isa: str) -> ctypes.CDLL:
    lib = native.load(isa)
    if lib is None:
        pytest.skip("no C compiler: the CPU kernels are not built")
    return lib


@pytest.fixture(params=native.supported_isas())
def kernel(request) -> ctypes.CDLL:
    return loaded(request.param)


def _avx512_builds() -> list:
    builds = [isa for isa in native.supported_isas() if "avx512f" in native.isa_named(isa).features]
    return builds or [pytest.param("", marks=pytest.mark.skip(reason="no AVX-512 on this CPU"))]


@pytest.fixture(params=_avx512_builds())
def avx512_kernel(request) -> ctypes.CDLL:
    return loaded(request.param)


@pytest.fixture
def best_kernel() -> ctypes.CDLL:
    return loaded(native.AUTO)
