"""The CPU kernels' boundary: one ABI header the compiler and ctypes both read, every instruction set's build
compiled here, one chooser of every CPU path (logged in one line, forced by `cpu_kernels`), and batch invariance
said in the worker's registration and required by `require_batch_invariance`. Oracle: transformers' own greedy
tokens."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import sys

import pytest
import torch
from worker_oracle import Transformers, prompts, single_thread, write_tiny  # noqa: F401 (fixture)

from gpu_worker import cpu_paths
from kernels import native
from pagedserve.engine import Engine
from shared.sampling import SamplingParams
from shared.settings import Settings

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
needs_cc = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


@needs_cc
@pytest.mark.parametrize("isa", [isa.name for isa in native.ISAS])
def test_every_instruction_sets_build_compiles_here_whatever_this_cpu_runs(isa):
    (build,) = [i for i in native.ISAS if i.name == isa]
    assert native.build(build, native.compiler()).stat().st_size > 0


def test_every_entry_point_of_the_abi_header_is_typed_from_it():
    """The header is parsed into the ctypes types, and a definition that differs from its prototype there does not
    compile (each source includes it; a function missing from it is an error: -Werror=missing-prototypes)."""
    found = {p.name: p for p in native.prototypes(native.ABI.read_text())}
    defined = set()
    for source in native.SOURCES:
        defined |= set(re.findall(r"^(?:int|void|int64_t) (\w+)\(", source.read_text(), flags=re.M))
    assert set(found) == defined
    attention = found["paged_attention"]
    assert attention.restype is native.ctypes.c_int and len(attention.argtypes) == 19
    assert attention.argtypes[-2:] == (native.ctypes.c_float, native.ctypes.c_int)
    assert found["packed_size"].restype is native.ctypes.c_int64 and found["bf16_pack"].restype is None


@needs_cc
def test_a_definition_that_differs_from_the_abi_header_does_not_compile(tmp_path):
    source = tmp_path / "wrong.c"
    source.write_text('#include "cpu_kernels.h"\nint bf16_amx(int wrong) { return wrong; }\n')
    build = subprocess.run([native.compiler(), *native.FLAGS, "-I", str(native.HERE), str(source), "-o",
                            str(tmp_path / "wrong.so")], capture_output=True, text=True)
    assert build.returncode != 0 and "conflicting types" in build.stderr


def test_an_instruction_set_this_cpu_cannot_run_is_refused_by_name():
    with pytest.raises(ValueError, match="'avx1024' is not one this CPU runs"):
        native.isa_named("avx1024")


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_build_this_cpu_runs_gives_a_chooser_that_names_every_path(dtype):
    for isa in native.supported_isas():
        paths = cpu_paths.choose(isa, dtype, "cpu", 64, 16)
        assert paths.build == isa and paths.kernel is not None and paths.attention == "native"
        assert paths.batch_invariant == (paths.linears in ("amx", "avx512bf16", "fma"))
        line = paths.describe()
        for part in ("linears", "attention", "norm", "activation", "rotary", "sampling"):
            assert f"{part} {getattr(paths, part)}" in line
    torch_paths = cpu_paths.choose("torch", dtype, "cpu", 64, 16)
    assert torch_paths.kernel is None and not torch_paths.batch_invariant
    assert {torch_paths.attention, torch_paths.norm, torch_paths.rotary, torch_paths.sampling} == {"torch"}


def test_a_worker_forced_onto_torchs_paths_serves_correctly_and_says_it_is_not_batch_invariant(
        tiny_model_dir, caplog, single_thread):
    with caplog.at_level(logging.INFO, logger="gpu_worker.model_runner"):
        engine = Engine(Settings(model=str(tiny_model_dir), dtype="float32", cpu_kernels="torch"))
    (worker,) = engine.workers.values()
    assert not worker.registration.batch_invariant
    assert "CPU paths: kernels none, linears mkl, attention torch" in caplog.text
    assert "not batch invariant" in caplog.text
    batch = prompts([6, 21, 35], vocab=512, seed=3)
    got = [c.samples[0].token_ids for c in engine.generate(batch, GREEDY)]
    oracle = Transformers(tiny_model_dir)
    assert got == [oracle.greedy(p, GREEDY.max_tokens) for p in batch]


@needs_cc
def test_a_worker_with_the_c_kernels_registers_as_batch_invariant(tmp_path, single_thread):
    engine = Engine(Settings(model=str(write_tiny("llama", tmp_path / "llama")), dtype="bfloat16",
                             require_batch_invariance=True))
    (worker,) = engine.workers.values()
    assert worker.registration.batch_invariant and worker.runner.paths.build == native.supported_isas()[-1]


@pytest.mark.parametrize("settings", [{"cpu_kernels": "torch"}, {"attention_backend": "torch"}],
                         ids=["torch kernels", "torch attention"])
def test_a_worker_required_to_be_batch_invariant_refuses_to_start_without_the_c_kernels(tiny_model_dir, settings):
    with pytest.raises(RuntimeError, match="require_batch_invariance is set, and this worker is not batch "
                                           "invariant"):
        Engine(Settings(model=str(tiny_model_dir), dtype="float32", require_batch_invariance=True, **settings))


@needs_cc
def test_the_sanitized_build_stops_at_a_read_past_a_tensors_end(tmp_path):
    """What CI's sanitized run of the kernel tests relies on: with PAGEDSERVE_SANITIZE the library is built with
    AddressSanitizer, and a kernel reading past its input ends the process with the report."""
    asan = subprocess.run([native.compiler(), "-print-file-name=libasan.so"], capture_output=True, text=True).stdout
    if not asan.strip().startswith("/"):
        pytest.skip("no AddressSanitizer runtime for this compiler")
    script = ("import torch; from kernels import native; x = torch.randn(4, 100); out = torch.empty(8, "
              "dtype=torch.int64); native.load().rows_argmax(0, x.data_ptr(), 100, 8, 100, out.data_ptr())")
    env = {**os.environ, "PAGEDSERVE_SANITIZE": "address,undefined", "PAGEDSERVE_CACHE_DIR": str(tmp_path),
           "LD_PRELOAD": asan.strip(), "ASAN_OPTIONS": "detect_leaks=0"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0 and "AddressSanitizer: heap-buffer-overflow" in run.stderr
