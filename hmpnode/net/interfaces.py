"""The host's IPv4 interfaces, read with Linux ioctls (no dependency).

LAN discovery needs, per local IPv4 address: the device (to join multicast
groups and pick the outgoing interface), the subnet (to match a peer's
source address) and the broadcast address. `SIOCGIFCONF` lists every IPv4
address, secondary ones included (one `ifreq` per address, named by its
label, e.g. `eth0` or `eth0:1`); `SIOCGIFNETMASK` / `SIOCGIFBRDADDR` are asked
with the address filled in, so the kernel answers for that very address and
not for the device's primary one; `SIOCGIFFLAGS` gives up/loopback/multicast.

Broadcast address: the kernel's one when set; when an address was added
without one (`ip addr add` without `brd`, reported as 0.0.0.0) on an
IFF_BROADCAST device, and on loopback (no IFF_BROADCAST, but the kernel
installs `broadcast 127.255.255.255 dev lo` in its local table), the subnet's
all-ones address, to which the kernel delivers directed broadcasts all the
same. /31 and /32 networks have none.

Linux only (the ioctl numbers and `struct ifreq` layout are Linux's).
"""

from __future__ import annotations

import array
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["Interface", "interfaces", "interface_for", "IFF_UP", "IFF_BROADCAST", "IFF_LOOPBACK",
           "IFF_POINTOPOINT", "IFF_RUNNING", "IFF_MULTICAST"]

SIOCGIFCONF = 0x8912
SIOCGIFFLAGS = 0x8913
SIOCGIFADDR = 0x8915
SIOCGIFBRDADDR = 0x8919
SIOCGIFNETMASK = 0x891B

IFF_UP = 0x1
IFF_BROADCAST = 0x2
IFF_LOOPBACK = 0x8
IFF_POINTOPOINT = 0x10
IFF_RUNNING = 0x40
IFF_MULTICAST = 0x1000

_IFNAMSIZ = 16
# struct ifreq = char[16] + a union whose largest member is struct ifmap
# (2 longs, a short, 3 chars): 24 bytes with 8-byte longs, 16 with 4-byte ones.
_IFREQ_SIZE = _IFNAMSIZ + (24 if struct.calcsize("l") == 8 else 16)
_MAX_ADDRESSES = 4096


@dataclass(frozen=True, slots=True)
class Interface:
    """One IPv4 address of a network device."""

    #: device name (an alias label such as `eth0:1` is reported as `eth0`)
    name: str
    #: device index (`socket.if_nametoindex`), what multicast options and IP_PKTINFO use
    index: int
    address: ipaddress.IPv4Address
    #: the subnet, from the netmask (host bits cleared)
    network: ipaddress.IPv4Network
    #: where a directed broadcast for this subnet goes; None when there is none
    broadcast: ipaddress.IPv4Address | None
    #: IFF_* flags of the device
    flags: int

    @property
    def netmask(self) -> ipaddress.IPv4Address:
        return self.network.netmask

    @property
    def up(self) -> bool:
        return bool(self.flags & IFF_UP)

    @property
    def is_loopback(self) -> bool:
        return bool(self.flags & IFF_LOOPBACK)

    @property
    def multicast(self) -> bool:
        """Multicast usable: IFF_MULTICAST, or loopback (Linux delivers multicast
        on `lo` although it does not carry the flag)."""
        return bool(self.flags & (IFF_MULTICAST | IFF_LOOPBACK))

    @property
    def point_to_point(self) -> bool:
        return bool(self.flags & IFF_POINTOPOINT)


def _ifreq(label: bytes, address: bytes | None = None) -> bytes:
    """An ifreq for `label`, with an AF_INET sockaddr when `address` is given
    (the kernel then answers for that address, not the device's first)."""
    req = bytearray(_IFREQ_SIZE)
    req[:len(label)] = label
    if address is not None:
        struct.pack_into("=H2x4s", req, _IFNAMSIZ, socket.AF_INET, address)
    return bytes(req)  # immutable: fcntl.ioctl then returns the kernel's answer


def _ioctl_addr(sock: socket.socket, request: int, label: bytes, address: bytes) -> bytes | None:
    try:
        out = fcntl.ioctl(sock.fileno(), request, _ifreq(label, address))
    except OSError:
        return None
    return bytes(out[_IFNAMSIZ + 4:_IFNAMSIZ + 8])


def _list_addresses(sock: socket.socket) -> list[tuple[bytes, bytes]]:
    """(label, 4-byte address) of every IPv4 address (SIOCGIFCONF), growing
    the buffer until the answer fits."""
    count = 64
    while True:
        size = count * _IFREQ_SIZE
        buf = array.array("B", bytes(size))
        address, _ = buf.buffer_info()
        ifconf = struct.pack("iP", size, address)  # struct ifconf {int len; char *buf;}
        length = struct.unpack("iP", fcntl.ioctl(sock.fileno(), SIOCGIFCONF, ifconf))[0]
        if length < size or count >= _MAX_ADDRESSES:
            break
        count *= 4
    data = buf.tobytes()
    out = []
    for offset in range(0, length - _IFREQ_SIZE + 1, _IFREQ_SIZE):
        label = data[offset:offset + _IFNAMSIZ].split(b"\0", 1)[0]
        family = struct.unpack_from("=H", data, offset + _IFNAMSIZ)[0]
        if family == socket.AF_INET:
            out.append((label, data[offset + _IFNAMSIZ + 4:offset + _IFNAMSIZ + 8]))
    return out


def interfaces(*, include_down: bool = False) -> list[Interface]:
    """Every IPv4 address of the host (in the kernel's order), up devices only
    unless `include_down`. Raises OSError only when no socket can be made."""
    result: list[Interface] = []
    indexes = {name: index for index, name in socket.if_nameindex()}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for label, packed in _list_addresses(sock):
            name = label.split(b":", 1)[0].decode("ascii", "replace")
            index = indexes.get(name)
            if index is None:  # vanished between the two calls
                continue
            try:
                flags = struct.unpack_from("=H", fcntl.ioctl(sock.fileno(), SIOCGIFFLAGS, _ifreq(label)), _IFNAMSIZ)[0]
            except OSError:
                continue
            if not include_down and not flags & IFF_UP:
                continue
            mask = _ioctl_addr(sock, SIOCGIFNETMASK, label, packed)
            if mask is None:
                continue
            address = ipaddress.IPv4Address(packed)
            try:
                network = ipaddress.IPv4Network(f"{address}/{ipaddress.IPv4Address(mask)}", strict=False)
            except ValueError:  # a non-contiguous netmask: not a subnet we can reason about
                continue
            result.append(Interface(name, index, address, network, _broadcast(sock, label, packed, network, flags), flags))
    return result


def _broadcast(sock: socket.socket, label: bytes, packed: bytes, network: ipaddress.IPv4Network,
               flags: int) -> ipaddress.IPv4Address | None:
    if network.prefixlen >= 31 or not flags & (IFF_BROADCAST | IFF_LOOPBACK):
        return None
    if flags & IFF_BROADCAST:
        brd = _ioctl_addr(sock, SIOCGIFBRDADDR, label, packed)
        if brd is not None and brd != b"\0\0\0\0":
            return ipaddress.IPv4Address(brd)
    return network.broadcast_address


def interface_for(ip: str | ipaddress.IPv4Address, ifaces: Iterable[Interface] | None = None) -> Interface | None:
    """The interface of `ip`: the one that has it as its address, else the one
    whose network contains it (longest prefix), else None. `ifaces` defaults to
    `interfaces()`; a non-IPv4 `ip` gives None."""
    try:
        addr = ipaddress.IPv4Address(ip)
    except ValueError:
        return None
    candidates = list(interfaces() if ifaces is None else ifaces)
    for iface in candidates:
        if iface.address == addr:
            return iface
    best = None
    for iface in candidates:
        if addr in iface.network and (best is None or iface.network.prefixlen > best.network.prefixlen):
            best = iface
    return best
