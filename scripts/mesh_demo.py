"""Start N local nodes, let them find each other, send containers, print who got what.

    ./scripts/mesh_demo [--nodes 5]

Node 0 runs as a relay (roles relay,mailman). Sent:
  1. a broadcast from node 1 (should reach every node);
  2. an encrypted container from node 1 to node 2 (only node 2 can open it;
     nobody else receives it);
  3. a `localhost`-scoped broadcast from node 3 (every node here is on this host);
  4. an encrypted container from node 1 to the last node while that node is
     offline: the relay holds it, and hands it over when the node comes back.
"""

from __future__ import annotations

import argparse
import asyncio
import time

from _meshlib import LocalMesh


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=5, help="at least 4 (default 5)")
    args = parser.parse_args()
    n = max(4, args.nodes)
    mesh = LocalMesh(n, roles={0: "relay,mailman"}, interval_ms=500)
    try:
        print(f"starting {n} nodes in {mesh.base} ...")
        mesh.start()
        took = await mesh.wait_discovered()
        print(f"all {n} nodes found each other in {took:.1f} s (no configuration: UDP multicast/broadcast on loopback)")
        for i, did in enumerate(mesh.dids):
            print(f"  node {i}: {did}{'  (relay, mailman)' if i == 0 else ''}")

        c = mesh.clients
        last = n - 1
        sent: list[tuple[str, str, int, int | None]] = []
        did = (await c[1].create("note", {"text": "hello, mesh"}, broadcast=True))["did"]
        sent.append(("broadcast from node 1", did, 1, None))
        secret = {"public_key": mesh.infos[2]["public_key"], "did": mesh.dids[2]}
        did = (await c[1].create("note", {"text": "for node 2 only"}, encrypt_for=[secret]))["did"]
        sent.append(("encrypted, node 1 -> node 2", did, 1, 2))
        did = (await c[3].create("note", {"text": "same host only"}, broadcast=True, network="localhost"))["did"]
        sent.append(("localhost broadcast from node 3", did, 3, None))

        # the last node goes offline once the others know it names node 0 as its mailman
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            peers = (await c[1].peers())["peers"]
            if any(p["did"] == mesh.dids[last] and mesh.dids[0] in p.get("mailman", []) for p in peers):
                break
            await asyncio.sleep(0.2)
        await mesh.stop_node(last)
        offline = {"public_key": mesh.infos[last]["public_key"], "did": mesh.dids[last]}
        did = (await c[1].create("note", {"text": "while you were away"}, encrypt_for=[offline]))["did"]
        sent.append((f"encrypted, node 1 -> node {last} (offline)", did, 1, last))
        await asyncio.sleep(2.0)
        held = (await c[0].status())["mesh"]["relay"]["held"]
        print(f"node {last} is offline; the relay (node 0) holds {held} container(s) for it")
        mesh.start([last])
        print(f"node {last} is back")
        await asyncio.sleep(3.0)

        print()
        header = "container".ljust(42) + "".join(f"n{i:<4}" for i in range(n))
        print(header)
        print("-" * len(header))
        for label, did, sender, recipient in sent:
            row = label.ljust(42)
            for i in range(n):
                if i == sender:
                    mark = "sent"
                elif not await mesh.holds(i, did):
                    mark = "."
                elif recipient is None:
                    mark = "yes"
                else:
                    opened = await c[i].get(did, decrypt=True)
                    mark = "open" if "payload" in opened else "held"
                row += f"{mark:<5}"
            print(row)
        print()
        print("sent: the sender · yes: received it · open: received it and decrypted it · held: received it, sealed · .: never received it")
        print(f"relay (node 0) holds now: {(await c[0].status())['mesh']['relay']['held']}")
        return 0
    finally:
        await mesh.close()


if __name__ == "__main__":
    raise SystemExit(asyncio.run(main()))
