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
