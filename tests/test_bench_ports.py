"""The device benchmarks' port guard: two jobs on one port once sent both jobs' load to one server."""

from __future__ import annotations

import socket

import pytest

from benchmarks.lib import serve

pytestmark = pytest.mark.bench


def _listen(reuse_port: bool = False, port: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_busy_port_is_refused_and_a_second_listener_is_counted() -> None:
    a = _listen(reuse_port=True)
    port = a.getsockname()[1]
    try:
        assert serve.tcp_listeners(port) == 1
        with pytest.raises(RuntimeError, match=f"port {port} already has a listener"):
            serve.check_port_free(port)
        b = _listen(reuse_port=True, port=port)  # what a second uvicorn did silently
        try:
            assert serve.tcp_listeners(port) == 2
        finally:
            b.close()
    finally:
        a.close()
    assert serve.tcp_listeners(port) == 0
    serve.check_port_free(port)


def test_listeners_are_counted_without_ipv6(monkeypatch) -> None:
    # A kernel booted with ipv6.disable=1 has no /proc/net/tcp6: the IPv4 listeners still count
    # (the guard must not turn itself off), and -1 only where no table is readable at all.
    a = _listen()
    port = a.getsockname()[1]
    try:
        monkeypatch.setattr(serve, "PROC_NET_TCP", ("/proc/net/tcp", "/nonexistent/tcp6"))
        assert serve.tcp_listeners(port) == 1
        with pytest.raises(RuntimeError, match="already has a listener"):
            serve.check_port_free(port)
        monkeypatch.setattr(serve, "PROC_NET_TCP", ("/nonexistent/tcp", "/nonexistent/tcp6"))
        assert serve.tcp_listeners(port) == -1
    finally:
        a.close()


def test_ipv6_listener_is_counted() -> None:
    s = socket.socket(socket.AF_INET6)
    s.bind(("::1", 0))
    s.listen()
    try:
        assert serve.tcp_listeners(s.getsockname()[1]) == 1
    finally:
        s.close()
