"""A userspace Ethernet switch that delays every frame: the "internet" of tests/natlab.py.

This kernel has no netem, and a NAT lab with zero-latency links fails hole punching that
works on real links (a stray SYN meets a reset before the other side's SYN has left), so
the lab's public segment is this process: it reads every frame arriving on every interface
of its namespace (AF_PACKET raw sockets), holds it for `--delay-ms`, then sends it out of
the port that learned the destination MAC (or floods it). One pass through the switch is
the one-way delay between any two hosts of the segment.

It attaches to interfaces that appear later (it rescans its namespace), prints
`attached NAME` once per interface so the lab can wait for it, keeps at most `--queue`
frames in flight (more are dropped and counted), and on SIGTERM/SIGINT stops, printing
`stopped {json counters}`. Standard library only: it runs as `python tests/natswitch.py`.
"""

from __future__ import annotations

import argparse
import collections
import json
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
PACKET_OUTGOING = 4  # sll_pkttype of the frames this socket itself sent
RESCAN_S = 0.05
RCVBUF = 4 << 20


class Switch:
    def __init__(self, delay_s: float, queue: int):
        self.delay_s = delay_s
        self.limit = queue
        self.ports: dict[str, socket.socket] = {}
        self.by_fd: dict[int, str] = {}
        self.macs: dict[bytes, str] = {}
        self.queue: collections.deque[tuple[float, str, bytes]] = collections.deque()
        self.epoll = select.epoll()
        self.counts = {"frames": 0, "forwarded": 0, "flooded": 0, "dropped_full": 0, "send_errors": 0}
        self.stopping = False

    def rescan(self) -> None:
        """Attach to every interface of the namespace not attached yet (except `lo`)."""
        for _index, name in socket.if_nameindex():
            if name == "lo" or name in self.ports:
                continue
            sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
            try:
                sock.bind((name, 0))
            except OSError:  # gone again, or not up yet: the next scan retries
                sock.close()
                continue
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
            sock.setblocking(False)
            self.ports[name] = sock
            self.by_fd[sock.fileno()] = name
            self.epoll.register(sock.fileno(), select.EPOLLIN)
            print(f"attached {name}", flush=True)

    def detach(self, name: str) -> None:
        sock = self.ports.pop(name)
        self.by_fd.pop(sock.fileno(), None)
        self.epoll.unregister(sock.fileno())
        sock.close()
        self.macs = {mac: port for mac, port in self.macs.items() if port != name}

    def receive(self, name: str, now: float) -> None:
        sock = self.ports[name]
        for _ in range(256):  # bounded per wake-up: the other ports get their turn
            try:
                frame, addr = sock.recvfrom(65536)
            except BlockingIOError:
                return
            except OSError:  # the interface went away
                self.detach(name)
                return
            if addr[2] == PACKET_OUTGOING or len(frame) < 14:
                continue
            self.counts["frames"] += 1
            if not frame[6] & 1:  # a unicast source MAC: learn where it lives
                self.macs[frame[6:12]] = name
            if len(self.queue) >= self.limit:
                self.counts["dropped_full"] += 1
                continue
            self.queue.append((now + self.delay_s, name, frame))

    def release(self, now: float) -> None:
        """Send every frame whose delay is over (the queue is in arrival order, one delay for all)."""
        while self.queue and self.queue[0][0] <= now:
            _due, came_in, frame = self.queue.popleft()
            out = None if frame[0] & 1 else self.macs.get(frame[0:6])
            if out == came_in:
                continue
            targets = [out] if out in self.ports else [p for p in self.ports if p != came_in]
            self.counts["forwarded" if len(targets) == 1 and out else "flooded"] += 1
            for port in targets:
                try:
                    self.ports[port].send(frame)
                except OSError:
                    self.counts["send_errors"] += 1

    def run(self) -> None:
        next_scan = 0.0
        while not self.stopping:
            now = time.monotonic()
            if now >= next_scan:
                self.rescan()
                next_scan = now + RESCAN_S
            wait = min(next_scan, self.queue[0][0] if self.queue else next_scan) - now
            for fd, _events in self.epoll.poll(max(0.0, wait)):
                name = self.by_fd.get(fd)
                if name is not None:
                    self.receive(name, time.monotonic())
            self.release(time.monotonic())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--delay-ms", type=float, default=5.0, help="one-way delay added to every frame")
    parser.add_argument("--queue", type=int, default=20000, help="frames in flight at most; more are dropped")
    args = parser.parse_args(argv)
    if args.delay_ms < 0 or args.queue < 1:
        parser.error("--delay-ms must be >= 0 and --queue >= 1")
    switch = Switch(args.delay_ms / 1000, args.queue)

    def stop(_signum, _frame):
        switch.stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    switch.run()
    print("stopped " + json.dumps(switch.counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
