"""Plain-socket hole punching for the NAT lab (no hmpnode code): what the lab allows.

    python tests/natprobe.py rendezvous PORT PAIRS
    python tests/natprobe.py peer NAME PAIR RENDEZVOUS_IP PORT
    python tests/natprobe.py connect IP PORT TIMES   /   python tests/natprobe.py listen PORT

The rendezvous (on a public host) takes PAIRS pairs of peers; each peer connects to it from
a freshly bound port P (SO_REUSEADDR + SO_REUSEPORT) and says its name and pair id. When
both of a pair are in, the rendezvous tells each the other's address as it saw it (the
public address of the peer's NAT mapping) and a start time a moment ahead (the lab's
namespaces share one clock). At that time each peer listens on P and connects from P to
the other (TCP simultaneous open; the listener takes a SYN that matches no socket, which is
how a peer with a 1:1 address gets a connection from a symmetric NAT). On an established
connection both send their names; the peer prints one JSON line:
{"ok": bool, "how": "connect"|"accept"|null, "error": str|null, "observed": "ip:port" (as the
rendezvous saw it), "local_port": P}.
Standard library only; every wait is bounded.
"""

from __future__ import annotations

import errno
import json
import select
import socket
import sys
import time

LEAD_S = 0.4  # start time this far after both peers of a pair have registered
PUNCH_S = 3.0  # how long a peer tries


def _bound(port: int = 0) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(("0.0.0.0", port))
    return sock


def _line(sock: socket.socket, deadline: float) -> str:
    data = b""
    while not data.endswith(b"\n"):
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(256)
        if not chunk:
            raise ConnectionError("closed")
        data += chunk
        if len(data) > 1024:
            raise ValueError("line too long")
    return data.decode().strip()


def rendezvous(port: int, pairs: int, timeout: float = 30.0) -> None:
    """Pair up `pairs` pairs; gives up after `timeout` s without a newcomer."""
    server = _bound(port)
    server.listen(64)
    deadline = time.monotonic() + timeout
    waiting: dict[str, tuple[socket.socket, str, str]] = {}
    done = 0
    held = []
    print("ready", flush=True)
    while done < pairs and time.monotonic() < deadline:
        server.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            conn, (ip, cport) = server.accept()
        except TimeoutError:
            break
        deadline = time.monotonic() + timeout  # idle timeout: however many pairs come
        name, pair = _line(conn, deadline).split()
        if pair not in waiting:
            waiting[pair] = (conn, name, f"{ip}:{cport}")
            continue
        other, other_name, other_addr = waiting.pop(pair)
        start = time.time() + LEAD_S
        conn.sendall(f"{other_name} {other_addr} {ip}:{cport} {start}\n".encode())
        other.sendall(f"{name} {ip}:{cport} {other_addr} {start}\n".encode())
        held += [conn, other]  # closed at exit: the peers keep their mappings alive meanwhile
        done += 1


def _at(start: float) -> None:
    """Sleep until wall-clock `start`, the last 5 ms spinning (wake-up jitter is the enemy)."""
    while (left := start - time.time()) > 0.005:
        time.sleep(left - 0.005)
    while time.time() < start:
        pass


def punch(name: str, pair: str, rendezvous_ip: str, port: int) -> dict:
    deadline = time.monotonic() + 30
    while True:  # the rendezvous may not listen yet
        to_rv = _bound()
        to_rv.settimeout(10)
        try:
            to_rv.connect((rendezvous_ip, port))
            break
        except ConnectionRefusedError:
            to_rv.close()
            if time.monotonic() > deadline - 20:
                raise
            time.sleep(0.05)
    local = to_rv.getsockname()[1]
    to_rv.sendall(f"{name} {pair}\n".encode())
    other_name, other_addr, observed, start = _line(to_rv, deadline).split()
    other_ip, other_port = other_addr.rsplit(":", 1)
    listener = _bound(local)
    listener.listen(4)
    listener.setblocking(False)
    dialer = _bound(local)
    dialer.setblocking(False)
    _at(float(start))
    dialer.connect_ex((other_ip, int(other_port)))
    result = {"ok": False, "how": None, "error": None, "observed": observed, "local_port": local}
    until = time.monotonic() + PUNCH_S
    watching = {listener: "accept", dialer: "connect"}
    while watching and not result["ok"] and time.monotonic() < until:
        readable, writable, _ = select.select([s for s, how in watching.items() if how == "accept"],
                                              [s for s, how in watching.items() if how == "connect"],
                                              [], max(0.0, until - time.monotonic()))
        for sock in readable + writable:
            if watching[sock] == "accept":
                try:
                    conn, _addr = sock.accept()
                except BlockingIOError:
                    continue
                how = "accept"
            else:
                err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    result["error"] = f"connect: {errno.errorcode.get(err, err)}"
                    del watching[sock]
                    continue
                conn, how = sock, "connect"
            try:
                conn.setblocking(True)
                conn.sendall(f"{name}\n".encode())
                heard = _line(conn, time.monotonic() + 2)
            except (OSError, ValueError) as exc:
                result["error"] = f"{how}: {exc}"
                continue
            if heard == other_name:
                result.update(ok=True, how=how, error=None)
                break
    if not result["ok"] and result["error"] is None:
        result["error"] = "timeout"
    return result


def connect(ip: str, port: int, times: int) -> dict:
    """`times` TCP connects to ip:port: {"ok", "ms": [one per connect: SYN to SYN-ACK, one
    round trip], "error"}; the first failure ends it."""
    out: dict = {"ok": True, "ms": [], "error": None}
    for _ in range(times):
        t0 = time.monotonic()
        try:
            socket.create_connection((ip, port), timeout=3).close()
        except OSError as exc:
            out.update(ok=False, error=type(exc).__name__)
            break
        out["ms"].append(round((time.monotonic() - t0) * 1000, 3))
    return out


def listen(port: int, timeout: float = 20.0) -> None:
    """Accept connections for `timeout` s, printing each peer's address."""
    server = _bound(port)
    server.listen(16)
    print("ready", flush=True)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            conn, addr = server.accept()
        except TimeoutError:
            break
        print(f"{addr[0]}:{addr[1]}", flush=True)
        conn.close()


def main(argv: list[str]) -> int:
    cmd, *args = argv
    if cmd == "rendezvous":
        rendezvous(int(args[0]), int(args[1]))
    elif cmd == "peer":
        print(json.dumps(punch(args[0], args[1], args[2], int(args[3]))), flush=True)
    elif cmd == "connect":
        print(json.dumps(connect(args[0], int(args[1]), int(args[2]))), flush=True)
    elif cmd == "listen":
        listen(int(args[0]))
    else:
        raise SystemExit(f"unknown command {cmd!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
