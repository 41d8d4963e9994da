"""A free TCP port on the loopback interface for a rendezvous (``MASTER_PORT``).

Not an OS-chosen ephemeral port: between choosing a port and rank 0 binding it, any outgoing
connection on the machine (gloo opens many, between every pair of ranks of every job) may be
given that same ephemeral port, and rank 0 then fails with EADDRINUSE — seen under load when
several spawned worlds run at once. Ports below the kernel's ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``) are never handed to outgoing connections, so a
random one of those that binds now stays free unless another listener picks the very same
number.
"""

from __future__ import annotations

import random
import socket

_LOW = 10_000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    hi = _ephemeral_start()
    rng = random.SystemRandom()
    if hi - _LOW > 1000:
        for _ in range(100):
            port = rng.randrange(_LOW, hi)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # fallback: the OS's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
