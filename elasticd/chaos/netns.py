"""Network-namespace hosts for a chaos run: the names and addresses (pure), and the ``ip`` commands
that make, cut and delete them.

Owns ``NetnsPlan`` (every name of one run starts with ``ecd<pid>``, every address is in a /24 of
``NETNS_NET`` no one else uses), whether netns hosts can be had here (``netns_unusable``,
``use_netns``, ``probe_netns``), and ``NetnsHosts``: a bridge and one namespace per host, joined by
a veth pair whose root end ``link_down`` takes down. It deletes only what it made, by name, and
never decides which host to cut or when.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from elasticd.errors import ConfigError

IP_TIMEOUT_S = 10.0  # bound on one `ip` command
NETNS_NET = "10.213"  # the private /16 whose /24s the run's bridges use (only addresses it creates)
NETNS_HOST_BASE = 10  # host i of a run has address <subnet>.<10 + i>
NETNS_MAX_HOSTS = 240  # so host addresses stay within .10-.249


# ---------------------------------------------------------------------------------------------
# The plan (pure)


@dataclass(frozen=True)
class NetnsHost:
    """One host: a namespace, joined to the run's bridge by a veth pair."""

    index: int
    ns: str  # the namespace (`ip netns`)
    root_veth: str  # the end enslaved to the bridge, in the root namespace: `link_down` takes it down
    ns_veth: str  # the end moved into the namespace, holding ``addr``
    addr: str


@dataclass(frozen=True)
class NetnsPlan:
    """The names and addresses of one run: every name starts with ``prefix`` (``ecd<pid>``), so
    that two runs never collide and cleanup deletes by name only what this run created. Interface
    names stay within Linux's 15 characters."""

    prefix: str
    subnet: int  # the third octet: the bridge is NETNS_NET.<subnet>.1/24

    @property
    def bridge(self) -> str:
        return f"{self.prefix}b"

    @property
    def bridge_addr(self) -> str:
        return f"{NETNS_NET}.{self.subnet}.1"

    def host(self, index: int) -> NetnsHost:
        """Host ``index`` (node-<index>).

        Raises:
            ValueError: the index is outside 0..NETNS_MAX_HOSTS - 1.
        """
        if not 0 <= index < NETNS_MAX_HOSTS:
            raise ValueError(f"host index {index} outside 0..{NETNS_MAX_HOSTS - 1}")
        return NetnsHost(
            index,
            f"{self.prefix}h{index}",
            f"{self.prefix}r{index}",
            f"{self.prefix}n{index}",
            f"{NETNS_NET}.{self.subnet}.{NETNS_HOST_BASE + index}",
        )


def subnets_in_use(ip_output: str) -> set[int]:
    """The /24s of NETNS_NET that addresses or routes already use (``ip -o -4 addr`` and ``ip -4
    route`` output), as their third octets."""
    return {int(m) for m in re.findall(rf"\b{re.escape(NETNS_NET)}\.(\d{{1,3}})\.", ip_output) if int(m) < 256}


def netns_plan(pid: int, in_use: Iterable[int]) -> NetnsPlan:
    """The plan of the run with this pid: the first /24 not in use, starting from one picked by the
    pid (so that concurrent runs start apart).

    Raises:
        ConfigError: every /24 of NETNS_NET is in use.
    """
    used = set(in_use)
    for offset in range(254):
        subnet = 1 + (pid + offset) % 254
        if subnet not in used:
            return NetnsPlan(f"ecd{pid}", subnet)
    raise ConfigError(f"--netns: every {NETNS_NET}.X.0/24 is in use on this machine")


def host_index(node: str) -> int:
    """The host index of a node id ``node-<i>``.

    Raises:
        ValueError: not a node id of this run.
    """
    prefix, _, number = node.rpartition("-")
    if prefix != "node" or not number.isdigit():
        raise ValueError(f"not a node id of a chaos run: {node!r}")
    return int(number)


def netns_unusable(euid: int, ip_binary: str | None, probe_error: str) -> str:
    """Why network-namespace hosts cannot be made here ("" when they can)."""
    if euid != 0:
        return "not root"
    if ip_binary is None:
        return "no `ip` binary (apt-get install iproute2)"
    if probe_error:
        return f"`ip netns` does not work here: {probe_error}"
    return ""


def use_netns(flag: bool | None, unusable: str) -> bool:
    """``--netns`` / ``--no-netns`` / neither (None: on when possible) against why it is not possible.

    Raises:
        ConfigError: ``--netns`` was asked for and cannot be had.
    """
    if flag is True and unusable:
        raise ConfigError(f"--netns: {unusable}")
    return flag is not False and not unusable


# ---------------------------------------------------------------------------------------------
# The ip commands


def _ip(ip: str, *args: str) -> None:
    """Run one ``ip`` command.

    Raises:
        RuntimeError: it failed or ran past IP_TIMEOUT_S (the message holds its stderr).
    """
    try:
        done = subprocess.run([ip, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"ip {' '.join(args)}: {exc}") from exc
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: exit {done.returncode}: {done.stderr.strip()[:200]}")


def probe_netns(ip: str, pid: int) -> str:
    """Try what a run does (a namespace, a bridge, a veth pair), then delete them: "" when it
    works, else what failed."""
    ns, bridge, veth = f"ecd{pid}p", f"ecd{pid}pb", f"ecd{pid}pv"
    try:
        _ip(ip, "netns", "add", ns)
        _ip(ip, "link", "add", bridge, "type", "bridge")
        _ip(ip, "link", "add", veth, "type", "veth", "peer", "name", f"{veth}n")
        _ip(ip, "link", "set", f"{veth}n", "netns", ns)
        _ip(ip, "netns", "exec", ns, ip, "link", "set", "lo", "up")
    except RuntimeError as exc:
        return str(exc)
    finally:
        for args in (("link", "del", veth), ("link", "del", bridge), ("netns", "del", ns)):
            try:
                _ip(ip, *args)
            except RuntimeError:
                pass  # never made, or gone with its peer
    return ""


def unusable_here(pid: int) -> str:
    """Why network-namespace hosts cannot be made on this machine now ("" when they can): not
    root, no ``ip``, or what the probe (``probe_netns``, under names made from ``pid``) met."""
    ip = shutil.which("ip")
    euid = os.geteuid()
    return netns_unusable(euid, ip, probe_netns(ip, pid) if euid == 0 and ip is not None else "")


def ip_addresses_and_routes(ip: str) -> str:
    """``ip -o -4 addr`` and ``ip -4 route`` of the root namespace ("" when they fail)."""
    out = []
    for args in (("-o", "-4", "addr"), ("-4", "route")):
        try:
            done = subprocess.run([ip, *args], capture_output=True, text=True, timeout=IP_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        out.append(done.stdout)
    return "\n".join(out)


class NetnsHosts:
    """The run's network: a bridge with ``plan.bridge_addr``/24 in the root namespace, and one
    namespace per host (made on first use), joined to the bridge by a veth pair. Everything is
    deleted by the names it was made under (``remove``, idempotent; also registered with atexit)."""

    def __init__(self, plan: NetnsPlan, ip: str, say: Callable[[str], None]) -> None:
        self.plan = plan
        self.ip = ip
        self.say = say
        self.hosts: dict[int, NetnsHost] = {}
        self._made: list[tuple[str, ...]] = []  # the delete command of each thing made, in order

    def setup(self) -> None:
        """Make the bridge (etcd listens on its address, so before etcd starts).

        Raises:
            RuntimeError: an ``ip`` command failed.
        """
        p = self.plan
        _ip(self.ip, "link", "add", p.bridge, "type", "bridge")
        self._made.append(("link", "del", p.bridge))
        _ip(self.ip, "addr", "add", f"{p.bridge_addr}/24", "dev", p.bridge)
        _ip(self.ip, "link", "set", p.bridge, "up")

    def host(self, index: int) -> NetnsHost:
        """Host ``index``, made now if it is new.

        Raises:
            ValueError: the index is out of the plan's range.
            RuntimeError: an ``ip`` command failed.
        """
        if index in self.hosts:
            return self.hosts[index]
        h = self.plan.host(index)
        _ip(self.ip, "netns", "add", h.ns)
        self._made.append(("netns", "del", h.ns))
        _ip(self.ip, "link", "add", h.root_veth, "type", "veth", "peer", "name", h.ns_veth)
        self._made.append(("link", "del", h.root_veth))  # takes its peer along
        _ip(self.ip, "link", "set", h.root_veth, "master", self.plan.bridge)
        _ip(self.ip, "link", "set", h.root_veth, "up")
        _ip(self.ip, "link", "set", h.ns_veth, "netns", h.ns)
        for args in (
            ("addr", "add", f"{h.addr}/24", "dev", h.ns_veth),
            ("link", "set", h.ns_veth, "up"),
            ("link", "set", "lo", "up"),
        ):
            _ip(self.ip, "netns", "exec", h.ns, self.ip, *args)
        self.hosts[index] = h
        self.say(f"host {h.ns}: {h.addr} (veth {h.root_veth} on {self.plan.bridge})")
        return h

    def set_link(self, host: NetnsHost, up: bool) -> None:
        """``ip link set <root-side veth> up|down``.

        Raises:
            RuntimeError: the command failed.
        """
        _ip(self.ip, "link", "set", host.root_veth, "up" if up else "down")

    def flap(self, host: NetnsHost, cycles: int, down_s: float, up_s: float, stop: threading.Event) -> None:
        """Take the host's link down for ``down_s``, then up for ``up_s``, ``cycles`` times (or until
        ``stop``); it ends up.

        Raises:
            RuntimeError: a command failed (the link is set up again first, where it can be).
        """
        try:
            for _ in range(cycles):
                self.set_link(host, up=False)
                stop.wait(down_s)
                self.set_link(host, up=True)
                if stop.wait(up_s):
                    return
        except RuntimeError:
            with contextlib.suppress(RuntimeError):
                self.set_link(host, up=True)
            raise

    def exec_prefix(self, host: NetnsHost) -> list[str]:
        """The command prefix that runs a program on ``host`` (``ip netns exec`` execs it in place,
        so the pid Popen returns is the program's)."""
        return [self.ip, "netns", "exec", host.ns]

    def remove(self) -> None:
        """Delete what was made, newest first, by name (run after the processes in it ended)."""
        while self._made:
            args = self._made.pop()
            try:
                _ip(self.ip, *args)
            except RuntimeError as exc:
                print(f"elasticd.chaos: cleanup: {exc}", file=sys.stderr, flush=True)
