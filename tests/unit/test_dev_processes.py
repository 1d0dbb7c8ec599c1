"""Ports for the services we start (include/eagle3_data/dev/processes.py): below the kernel's
ephemeral range, which the kernel also hands to outgoing connections while a service is still
starting; the range is read here from the kernel, not from the code under test."""

from __future__ import annotations

import socket
from pathlib import Path

from eagle3_data.dev.processes import free_port


def test_free_ports_lie_below_the_ephemeral_range_and_are_bindable_and_distinct():
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(1024 < p < ephemeral_low for p in ports), (ephemeral_low, ports)
    for port in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
            s.listen()


def test_the_start_up_poll_builds_no_client_per_request_and_a_fork_gets_its_own(monkeypatch):
    """`http_ok` polls every 0.2 s while a server starts: one client (and one SSL context, ~20 ms
    of CPU to load the CA bundle) per process, not per poll; a forked child (another pid) makes
    its own and polls with it."""
    import os
    import ssl

    from eagle3_data.dev import processes
    from eagle3_data.forksafe import PerProcess

    built = []
    real = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **kw: built.append(1) or real(*a, **kw))
    monkeypatch.setattr(processes, "_LOCAL_HTTP", PerProcess(processes._http_client))  # none built yet
    closed = f"http://127.0.0.1:{free_port()}/health"  # nothing listens: refused at once
    assert not any(processes.http_ok(closed) for _ in range(20))
    assert len(built) == 1
    parent, pid = processes.local_http(), os.getpid()
    monkeypatch.setattr(os, "getpid", lambda: pid + 1)  # what a forked child sees
    child = processes.local_http()
    assert child is not parent and not processes.http_ok(closed) and len(built) == 2
    assert processes.local_http() is child
