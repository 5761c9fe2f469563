"""A LanDiscovery node as a process, for the namespace tests (tests/test_lan.py).

    python -m tests.lan_peer --seed 1 --port 47474 --mode multicast --iface 10.77.1.1 \
        --expect 1 --linger 1.0 --timeout 10

Announces `tcp://<address>:7420` for each interface address it uses, runs
until it has found `--expect` other DIDs and then `--linger` seconds more (so
that anything else it could hear has time to arrive), or until `--timeout`;
then prints one JSON line: {"did", "found": {did: {"source_ip", "via",
"interface", "tcp"}}, "stats"} and exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson

from hmpnode.container.verify import encode_wire
from hmpnode.identity.keys import Identity
from hmpnode.net.announce import build_peer_announce
from hmpnode.net.lan import Accepted, LanDiscovery, LanSettings, pick_address, utc_now
from hmpnode.net.interfaces import Interface

DIFFICULTY = 2


async def main(args: argparse.Namespace) -> dict:
    identity = Identity(bytes([args.seed]) * 32)
    settings = LanSettings(port=args.port, mode=args.mode, interval=args.interval,
                           interfaces=args.iface or None, min_difficulty=DIFFICULTY)
    found: dict[str, dict] = {}
    enough = asyncio.Event()
    lan: LanDiscovery

    def announce() -> bytes:
        addrs = [f"tcp://{i.address}:7420" for i in lan.interfaces if not i.is_loopback] or ["tcp://127.0.0.1:7420"]
        return encode_wire(build_peer_announce(identity, addresses=addrs, now=utc_now(), difficulty=DIFFICULTY))

    def on_peer(accepted: Accepted, source_ip: str, iface: Interface) -> None:
        found[accepted.check.did] = {"source_ip": source_ip, "interface": str(iface.address),
                                     "via": lan.peers()[accepted.check.did].via,
                                     "tcp": pick_address(accepted.check, source_ip, "tcp", [iface])}
        if len(found) >= args.expect:
            enough.set()

    lan = LanDiscovery(settings, own_did=identity.did, announce=announce, on_peer=on_peer)
    async with lan:
        try:
            await asyncio.wait_for(enough.wait(), args.timeout)
            await asyncio.sleep(args.linger)
        except asyncio.TimeoutError:
            pass
        stats = lan.stats()
    return {"did": identity.did, "found": found, "stats": stats}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", default="both")
    parser.add_argument("--iface", action="append", default=[])
    parser.add_argument("--interval", type=float, default=0.3)
    parser.add_argument("--expect", type=int, default=1)
    parser.add_argument("--linger", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=10.0)
    result = asyncio.run(main(parser.parse_args()))
    sys.stdout.write(orjson.dumps(result).decode() + "\n")
