"""The `pagedserve` command's small promises: what `tiny-model` writes is readable by other users, and
`generate --help` offers only the settings the in-process engine reads."""
from __future__ import annotations

import stat

import pytest

from pagedserve.cli import ENGINE_SETTINGS, build_parser


def test_every_file_of_the_tiny_model_is_readable_by_other_users(tiny_model_dir):
    # The compose images read the checkpoint as uid 1000 from a read-only mount.
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tiny_model_dir.iterdir()}
    assert "model.safetensors" in modes
    assert modes == {name: 0o644 for name in modes}


def test_generate_help_lists_engine_settings_and_no_server_ones(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--help"])
    text = capsys.readouterr().out
    for name in ENGINE_SETTINGS:
        assert f"--{name.replace('_', '-')}" in text
    for server_only in ("--port", "--host", "--api-key", "--redis-url", "--worker-id", "--heartbeat-ttl",
                        "--max-waiting-requests", "--max-body-bytes", "--request-timeout"):
        assert server_only not in text
