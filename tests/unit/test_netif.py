"""Which interface a gloo group binds: the one that routes to its master, unless the user chose one."""

from __future__ import annotations

import os
import socket
import sys

import pytest

from raygym.cluster import netif

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="interfaces are read the Linux way")


def test_loopback_and_unknown_addresses() -> None:
    assert netif.local_address_towards("127.0.0.1") == "127.0.0.1"
    assert netif.interface_of("127.0.0.1") == "lo"
    assert netif.interface_of("203.0.113.77") is None  # TEST-NET-3: held by no interface here
    assert netif.interface_of("not-an-address") is None


def test_an_outward_address_is_held_by_a_real_interface() -> None:
    try:
        mine = netif.local_address_towards("192.0.2.1")  # TEST-NET-1: only the route is asked, nothing sent
    except OSError:
        pytest.skip("no route off this machine")
    name = netif.interface_of(mine)
    assert name is not None and name in {n for _, n in socket.if_nameindex()}


def test_pin_follows_the_master_and_keeps_the_users_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(netif.GLOO_IFNAME_ENV, raising=False)
    monkeypatch.setattr(netif, "_pinned", None)
    assert netif.pin_gloo_interface("127.0.0.1") == "lo"
    assert os.environ[netif.GLOO_IFNAME_ENV] == "lo"
    monkeypatch.setattr(netif, "interface_of", lambda address: "eth7")
    assert netif.pin_gloo_interface("127.0.0.1") == "eth7"  # its own earlier choice is updated
    monkeypatch.setenv(netif.GLOO_IFNAME_ENV, "ib0")  # the user's
    assert netif.pin_gloo_interface("127.0.0.1") == "ib0"
