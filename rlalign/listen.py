"""Listening sockets for rlalign's local servers (the explorers' page, ``rlalign serve-reward``)."""

from __future__ import annotations

import ipaddress
import socket

from rlalign.errors import RLAlignError

__all__ = ["bound_socket", "base_url", "is_loopback"]


def bound_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (port 0: a free one; IPv6 when ``host`` has a colon).

    Raises:
        RLAlignError: naming the address and the system's reason when it cannot be bound.
    """
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise RLAlignError(f"cannot listen on {host}:{port}: {err.strerror}") from err
    return sock


def base_url(host: str, port: int) -> str:
    """http://host:port, with an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def is_loopback(host: str) -> bool:
    """Whether ``host`` is this machine only: ``localhost``, 127.0.0.0/8 or ::1."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to any address
        return False
