"""The device benchmarks' port guard: two jobs on one port once sent both jobs' load to one server."""

from __future__ import annotations

import socket

import pytest

from benchmarks.lib import serve as ab

pytestmark = pytest.mark.bench


def _listen(reuse_port: bool = False, port: int = 0) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def test_job_ports_differ_between_parallel_jobs() -> None:
    # Device jobs run one per GPU at once; perf-boost uses slots 10.., the A/B slots 1 and 2.
    ports = {ab.job_port(g, slot) for g in (0, 1, 2, 3) for slot in (1, 2, *range(10, 40))}
    assert len(ports) == 4 * 32


def test_busy_port_is_refused_and_a_second_listener_is_counted() -> None:
    a = _listen(reuse_port=True)
    port = a.getsockname()[1]
    try:
        assert ab.tcp_listeners(port) == 1
        with pytest.raises(RuntimeError, match=f"port {port} already has a listener"):
            ab.check_port_free(port)
        b = _listen(reuse_port=True, port=port)  # what a second uvicorn did silently
        try:
            assert ab.tcp_listeners(port) == 2
        finally:
            b.close()
    finally:
        a.close()
    assert ab.tcp_listeners(port) == 0
    ab.check_port_free(port)


def test_listeners_are_counted_without_ipv6(monkeypatch) -> None:
    # A kernel booted with ipv6.disable=1 has no /proc/net/tcp6: the IPv4 listeners still count
    # (the guard must not turn itself off), and -1 only where no table is readable at all.
    a = _listen()
    port = a.getsockname()[1]
    try:
        monkeypatch.setattr(ab, "PROC_NET_TCP", ("/proc/net/tcp", "/nonexistent/tcp6"))
        assert ab.tcp_listeners(port) == 1
        with pytest.raises(RuntimeError, match="already has a listener"):
            ab.check_port_free(port)
        monkeypatch.setattr(ab, "PROC_NET_TCP", ("/nonexistent/tcp", "/nonexistent/tcp6"))
        assert ab.tcp_listeners(port) == -1
    finally:
        a.close()


def test_ipv6_listener_is_counted() -> None:
    s = socket.socket(socket.AF_INET6)
    s.bind(("::1", 0))
    s.listen()
    try:
        assert ab.tcp_listeners(s.getsockname()[1]) == 1
    finally:
        s.close()
