from __future__ import annotations

import argparse

import pytest

from shared.settings import Settings, SettingsError


def test_defaults_env_and_flags_in_order():
    assert Settings().block_size == 16
    env = {"PAGEDSERVE_BLOCK_SIZE": "32", "PAGEDSERVE_ENABLE_PREFIX_CACHING": "false", "PAGEDSERVE_PORT": "9000"}
    s = Settings.from_env(env)
    assert (s.block_size, s.enable_prefix_caching, s.port) == (32, False, 9000)
    parser = argparse.ArgumentParser()
    Settings.add_arguments(parser)
    ns = parser.parse_args(["--block-size", "64", "--preemption-mode", "swap"])
    s = Settings.from_args(ns, env)
    assert (s.block_size, s.preemption_mode, s.port, s.enable_prefix_caching) == (64, "swap", 9000, False)


@pytest.mark.parametrize("changes, message", [
    ({"block_size": 24}, "block_size must be a power of two from 8 to 128; got 24"),
    ({"block_size": 256}, "block_size must be a power of two"),
    ({"preemption_mode": "drop"}, "preemption_mode must be one of recompute, swap"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization must be in"),
    ({"max_num_seqs": 0}, "max_num_seqs must be at least 1"),
    ({"port": 70000}, "port must be in 1-65535"),
])
def test_bad_values_name_the_setting(changes, message):
    with pytest.raises(SettingsError, match=message):
        Settings(**changes)


def test_bad_env_value_names_the_setting():
    with pytest.raises(SettingsError, match="block_size expects an integer; got 'big'"):
        Settings.from_env({"PAGEDSERVE_BLOCK_SIZE": "big"})
