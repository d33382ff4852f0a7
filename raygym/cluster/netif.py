"""Which local address and network interface reach a peer: what a gloo process group must bind on a cluster.

gloo binds the address the machine's host name resolves to, falling back to loopback; on many machines the
host name resolves to 127.0.0.1 or 127.0.1.1 (Debian's default), and a container or network namespace may
not own the address at all. Peers on other nodes are then told to connect to a loopback address and never
meet. :func:`pin_gloo_interface` points gloo at the interface that routes to the group's master instead
(``GLOO_SOCKET_IFNAME``), unless the user set that variable. Pure standard library; Linux interfaces.

>>> local_address_towards("127.0.0.1")
'127.0.0.1'
>>> interface_of("127.0.0.1")
'lo'
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

logger = logging.getLogger(__name__)

GLOO_IFNAME_ENV = "GLOO_SOCKET_IFNAME"
_SIOCGIFADDR = 0x8915
_pinned: str | None = None  # the value this module last set (any other value was the user's)


def local_address_towards(peer: str) -> str:
    """The local address this machine (or network namespace) sends from to reach ``peer`` (an IP literal,
    IPv6 with or without brackets). No packet is sent: a UDP ``connect`` only asks the routing table."""
    host = peer.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, 9))
        return str(s.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The name of the local interface that holds ``address`` (None when none does, or not on Linux)."""
    try:
        wanted = ipaddress.ip_address(address.strip("[]").split("%")[0])
    except ValueError:
        return None
    if wanted.version == 6:
        return _ipv6_interface(wanted)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # an interface without an IPv4 address
                continue
            if ipaddress.ip_address(raw[20:24]) == wanted:
                return name
    return None


def _ipv6_interface(wanted: ipaddress.IPv6Address) -> str | None:
    try:
        with open("/proc/net/if_inet6") as table:
            for line in table:
                fields = line.split()
                if len(fields) >= 6 and ipaddress.IPv6Address(int(fields[0], 16)) == wanted:
                    return fields[5]
    except OSError:
        return None
    return None


def pin_gloo_interface(master_address: str) -> str | None:
    """Make gloo groups created afterwards in this process bind the interface that reaches
    ``master_address`` (sets ``GLOO_SOCKET_IFNAME``); returns the interface in use, None when it cannot be
    found (gloo's own choice then stands). A value the user set is kept."""
    global _pinned
    current = os.environ.get(GLOO_IFNAME_ENV)
    if current and current != _pinned:
        return current
    try:
        name = interface_of(local_address_towards(master_address))
    except OSError as exc:  # no route to the master: the group's own error will say so
        logger.debug("no route to %s: %s", master_address, exc)
        return None
    if name:
        os.environ[GLOO_IFNAME_ENV] = _pinned = name
    return name
