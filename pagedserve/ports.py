"""Ports on this machine: a free one to listen on, and why one is taken."""
from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_in_use(host: str, port: int) -> str | None:
    """Why a server could not listen on host:port (binding as aiohttp does), or None when it could."""
    try:
        addresses = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        return f"{host} does not resolve: {e}"
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            # SO_REUSEADDR as the servers set it: a connection of an earlier server lingering in TIME_WAIT
            # does not stop them, while a listening socket does.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                return f"{address[0]} port {port}: {e.strerror}"
    return None
