"""Restart mode's master port: picked below the kernel's ephemeral range, where no outgoing
connection can take it between the pick and the worker's bind."""

from __future__ import annotations

import socket

import pytest

from elasticd.agent.restart import PORT_PICK_LOW, pick_free_port

pytestmark = pytest.mark.timeout(30)


def test_a_port_below_the_ephemeral_range_that_is_free_now() -> None:
    for _ in range(20):
        port = pick_free_port(32768)
        assert PORT_PICK_LOW <= port < 32768
        with socket.socket() as s:
            s.bind(("", port))  # free


def test_a_taken_port_is_not_picked_and_no_range_falls_back_to_the_kernel() -> None:
    with socket.socket() as held:
        held.bind(("", PORT_PICK_LOW))
        held.listen()
        assert all(pick_free_port(PORT_PICK_LOW + 1) != PORT_PICK_LOW for _ in range(5))  # then the kernel's
    assert pick_free_port(PORT_PICK_LOW) >= 1024  # no room below: the kernel's pick
