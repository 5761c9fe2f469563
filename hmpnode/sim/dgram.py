"""A simulated UDP network on the virtual-time loop (`hmpnode.sim.vtime`).

`DatagramNetwork.create_datagram_endpoint` has the signature of the event loop's, so
code that binds a UDP socket through an injected endpoint factory (the node's DHT,
`hmpnode.net.dht.Dht(endpoint=...)`) runs on it unchanged. A datagram reaches the
addressed endpoint's `datagram_received` after a latency drawn from the network's
seeded RNG (20-80 ms by default), or is lost with probability `loss`. A host can be
set down (it neither sends nor receives, its endpoints stay bound: a partition or a
frozen machine); closing an endpoint unbinds it (a stopped process).

Every datagram sent is folded, in send order, into `digest` (time, source,
destination, bytes): two runs that send the same datagrams at the same virtual
times have the same digest, so it fingerprints a whole run.
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import random
import struct
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["DatagramNetwork", "SimTransport"]

Address = tuple[str, int]


class SimTransport(asyncio.DatagramTransport):
    """One bound endpoint of a `DatagramNetwork`."""

    def __init__(self, network: DatagramNetwork, address: Address, protocol: asyncio.DatagramProtocol):
        super().__init__()
        self._network = network
        self._address = address
        self._protocol = protocol
        self._closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._address if name == "sockname" else default

    def sendto(self, data: bytes, addr: Any = None) -> None:
        if not self._closing:
            self._network.send(self._address, (addr[0], addr[1]), bytes(data))

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._network.unbind(self._address)
        asyncio.get_running_loop().call_soon(self._protocol.connection_lost, None)

    def abort(self) -> None:
        self.close()

    def get_write_buffer_size(self) -> int:
        return 0


class DatagramNetwork:
    """In-memory datagrams between endpoints; must be used on a running (virtual) loop."""

    def __init__(self, rng: random.Random, *, latency: tuple[float, float] = (0.020, 0.080), loss: float = 0.0):
        if not 0 <= latency[0] <= latency[1]:
            raise ValueError("latency must be (low, high) seconds with 0 <= low <= high")
        if not 0 <= loss < 1:
            raise ValueError("loss must be in [0, 1)")
        self._rng = rng
        self.latency = latency
        self.loss = loss
        self._endpoints: dict[Address, tuple[SimTransport, asyncio.DatagramProtocol]] = {}
        self._down: set[str] = set()
        self._hash = hashlib.sha256()
        #: sent, delivered, lost (random loss), dropped_down (host down), unbound (no endpoint)
        self.counters: Counter[str] = Counter()

    async def create_datagram_endpoint(
        self, protocol_factory: Callable[[], asyncio.DatagramProtocol], local_addr: Address
    ) -> tuple[SimTransport, asyncio.DatagramProtocol]:
        """Bind `local_addr` (an explicit port; OSError EADDRINUSE if bound already)."""
        address = (local_addr[0], local_addr[1])
        if address in self._endpoints:
            raise OSError(errno.EADDRINUSE, f"{address[0]} port {address[1]} is bound already")
        protocol = protocol_factory()
        transport = SimTransport(self, address, protocol)
        self._endpoints[address] = (transport, protocol)
        protocol.connection_made(transport)
        return transport, protocol

    def unbind(self, address: Address) -> None:
        self._endpoints.pop(address, None)

    def set_down(self, host: str, down: bool = True) -> None:
        """Take `host` off the network (True) or back (False); its endpoints stay bound."""
        if down:
            self._down.add(host)
        else:
            self._down.discard(host)

    def is_down(self, host: str) -> bool:
        return host in self._down

    def send(self, source: Address, dest: Address, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.counters["sent"] += 1
        self._hash.update(struct.pack("!dH", loop.time(), len(data)))
        self._hash.update(f"{source[0]}:{source[1]}>{dest[0]}:{dest[1]}|".encode())
        self._hash.update(data)
        if source[0] in self._down:
            self.counters["dropped_down"] += 1
            return
        if self.loss and self._rng.random() < self.loss:
            self.counters["lost"] += 1
            return
        loop.call_later(self._rng.uniform(*self.latency), self._deliver, source, dest, data)

    def _deliver(self, source: Address, dest: Address, data: bytes) -> None:
        if dest[0] in self._down:
            self.counters["dropped_down"] += 1
            return
        bound = self._endpoints.get(dest)
        if bound is None:
            self.counters["unbound"] += 1
            return
        self.counters["delivered"] += 1
        bound[1].datagram_received(data, source)

    def digest(self) -> str:
        """sha256 (hex) over every datagram sent so far, in order."""
        return self._hash.hexdigest()
