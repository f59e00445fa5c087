"""The `pagedserve` command's small promises: what `tiny-model` writes is readable by other users,
`generate --help` offers only the settings the in-process engine reads, and `up --gateways N` is checked before
anything starts."""
from __future__ import annotations

import socket
import stat

import pytest
from up_harness import free_gateway_port

from pagedserve.cli import ENGINE_SETTINGS, build_parser
from pagedserve.launcher import Topology, settings_for_up, up


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


def test_up_runs_one_gateway_unless_told_and_refuses_a_taken_port_of_any_gateway(capsys):
    parser = build_parser()
    assert Topology.from_args(parser.parse_args(["up"])) == Topology(workers=1, gateways=1, redis_port=0)
    assert Topology.from_args(parser.parse_args(["up", "--gateways", "3"])).gateway_ports(8000) == {
        "gateway": 8000, "gateway-1": 8001, "gateway-2": 8002}
    assert Topology(gateways=0).problem(8000) == "--gateways must be at least 1; got 0"
    assert "past 65535" in Topology(gateways=2).problem(65535)
    port = free_gateway_port(2)
    with socket.socket() as taken:  # the second gateway's port
        taken.bind(("127.0.0.1", port + 1))
        taken.listen()
        args = parser.parse_args(["up", "--gateways", "2", "--port", str(port)])
        assert up(settings_for_up(args), Topology.from_args(args)) == 2
    said = capsys.readouterr().err
    assert f"port {port + 1}: Address already in use" in said and "nothing was started" in said
