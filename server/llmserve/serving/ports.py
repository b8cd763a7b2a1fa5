"""Whether a TCP port can be listened on: the one bind probe that start-up checks, the front end
and the tests share."""

from __future__ import annotations

import socket


def family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def bind_error(host: str, port: int) -> OSError | None:
    """Why (host, port) cannot be bound now, by a socket without SO_REUSEPORT (so that sockets that
    share the port with it count as taking it), or None when it can."""
    with socket.socket(family(host), socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e
    return None
