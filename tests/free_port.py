"""A free TCP port on 127.0.0.1, asked of the OS: the tests that start a process group or a server on this machine
never use a fixed port (suites run side by side, `make test`)."""

from __future__ import annotations

import socket

__all__ = ["free_port"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
