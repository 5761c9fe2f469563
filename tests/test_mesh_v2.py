"""Peer sessions v2 between two real nodes through a man in the middle (docs/protocol.md 21).

Node A is given node B's DID at the address of a TCP proxy on 127.0.0.1 (a row of its
peers table; the proxy is a tests/faultproxy.py one); it forwards to B, records every
byte and reads the WebSocket frames each way so that it can (a) only listen, (b) flip
one bit of a record, (c) replay one, (d) swap two, (e) inject an error frame as v1
sent them. After an attack it holds back what B sends to A until the test has looked
at B (B never dials: its target is 0; A has nothing to dial but the proxy until then),
so that nothing reaches B by another connection meanwhile.

Before v2 (cleartext JSON frames): the capture held both DIDs, the tag and the
payload; the attacks (b)-(d) never found a binary record to touch (timeout), and an
injected error frame was counted as the peer's (peer_error_banned)."""

from __future__ import annotations

import asyncio
import os

import orjson
import pytest

from tests.faultproxy import Connection, FaultProxy, Frame, ws_frame
from tests.meshutil import MeshNode, mesh_env, seed_peer, wait_for

#: a client->server (A->B) binary message larger than this carries our broadcast container
BIG = 3000
_NO_DISCOVERY = {"HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_DHT": "false"}


class Proxy(FaultProxy):
    """The man in the middle (module docstring): `arm(attack)` aims at the next A->B
    binary message over BIG bytes: "flip" (FaultProxy.flip), "replay", "reorder";
    `inject(frame)` writes a frame of our own towards B. `attacked` is set once it happened."""

    def __init__(self, target_port: int):
        super().__init__(target_port)
        self.capture = bytearray()
        self.attack: str | None = None
        self.attacked = asyncio.Event()
        self.release = asyncio.Event()
        self._held_back: list[bytes] = []
        self._reorder: bytes | None = None

    def arm(self, attack: str) -> None:
        self.attack = attack
        if attack == "flip":  # a bit in the middle of the record(s)
            self.flip(True, min_size=BIG + 1, offset=0.5).add_done_callback(lambda _: self.attacked.set())

    async def close(self) -> None:
        self.release.set()
        await super().close()

    def admit(self, conn: Connection) -> bool:
        return conn.index == 0  # one session under test

    def inject(self, frame: bytes) -> None:
        writer = self.connections[0].writer(True)
        assert writer is not None
        writer.write(frame)
        self.attacked.set()

    async def forward(self, conn: Connection, to_server: bool, frame: Frame) -> None:
        self.capture += frame.data
        if to_server:
            await self._a_to_b(conn, frame)
        elif self.attacked.is_set() and not self.release.is_set():
            self._held_back.append(frame.data)  # A learns nothing until the test has looked at B
        else:
            await conn.send(False, frame.data)

    async def finish(self, conn: Connection, to_server: bool) -> None:
        if not to_server:  # B is gone: A hears of it (the held frames, the close) once released
            await self.release.wait()
            for data in self._held_back:
                await conn.send(False, data)
        conn.close_side(to_server)

    async def _a_to_b(self, conn: Connection, frame: Frame) -> None:
        binary = frame.opcode == 0x2
        target = self.attack is not None and not self.attacked.is_set() and binary and frame.size > BIG
        if self._reorder is not None and binary:
            await conn.send(True, frame.data + self._reorder)  # the later record first, then the held one
            self._reorder = None
            self.attacked.set()
        elif target and self.attack == "replay":
            await conn.send(True, frame.data + frame.data)
            self.attacked.set()
        elif target and self.attack == "reorder":
            self._reorder = frame.data
        else:
            await conn.send(True, frame.data)


class Pair:
    def __init__(self, a: MeshNode, b: MeshNode, proxy: Proxy):
        self.a, self.b, self.proxy = a, b, proxy

    async def counters(self, node: MeshNode) -> tuple[dict, dict]:
        status = await node.client.status()
        return status["mesh"]["counters"], status["refused"]


@pytest.fixture
async def pair(nodes, tmp_path):
    b = MeshNode(nodes(tmp_path / "b", env=mesh_env(**_NO_DISCOVERY, HMPNODE_PEER_TARGET_PEERS="0",
                                                    HMPNODE_PEER_MIN_OUTBOUND="0")))
    proxy = Proxy(b.info["peer"]["port"])
    port = await proxy.start()
    a_env = mesh_env(**_NO_DISCOVERY)
    first = MeshNode(nodes(tmp_path / "a", env=a_env))  # creates the store
    await first.close()
    first.proc.stop()
    seed_peer(tmp_path / "a", b.did, f"tcp://127.0.0.1:{port}")
    a = MeshNode(nodes(tmp_path / "a", env=a_env))
    try:
        async def linked():
            return b.did in await a.connected() and a.did in await b.connected()

        await wait_for(linked, 30, "A and B to connect through the proxy")
        assert len(proxy.connections) == 1
        yield Pair(a, b, proxy)
    finally:
        await proxy.close()
        await a.close()
        await b.close()


def _b58(did: str) -> bytes:
    return did.rsplit(":", 1)[1].encode()


async def test_a_passive_observer_reads_no_did_tag_or_payload(pair):
    a, b, proxy = pair.a, pair.b, pair.proxy
    tag = "tag" + os.urandom(6).hex()
    plain = "payload-" + os.urandom(8).hex()
    sent = []
    for compression in (None, "zstd"):
        made = await a.client.create("note", {"text": f"{plain} {compression}"}, tags=[tag], broadcast=True,
                                     compression=compression)
        sent.append(made["did"])
    for did in sent:
        await wait_for(lambda did=did: b.holds(did), 20, "B to receive the broadcasts through the proxy")
    capture = bytes(proxy.capture)
    assert len(capture) > 4000  # the handshake and both containers went through
    for secret in (_b58(a.did), _b58(b.did), *map(_b58, sent), tag.encode(), plain.encode(),
                   a.public_key.encode(), b.public_key.encode(), b"peer_announce", b"hmp_container"):
        assert secret not in capture, secret


async def _attacked_session_ends(pair: Pair, reason: str) -> None:
    """After the attack: B ended the session and counted `reason`, stored nothing of the
    attacked container; once A hears of it, A's session ends too."""
    a, b, proxy = pair.a, pair.b, pair.proxy
    tag = "tag" + os.urandom(6).hex()
    made = await a.client.create("note", {"text": os.urandom(2 * BIG).hex()}, tags=[tag], broadcast=True)
    if proxy.attack == "reorder":  # a second record to put before the first
        await asyncio.sleep(0.5)
        await a.client.create("note", {"text": os.urandom(2 * BIG).hex()}, tags=[tag], broadcast=True)
    await asyncio.wait_for(proxy.attacked.wait(), 20)

    async def ended():
        counters, refused = await pair.counters(b)
        return counters.get("disconnected", 0) >= 1 and refused.get(f"peer:{reason}", 0) >= 1

    await wait_for(ended, 20, f"B to end the session on {reason}")
    counters, refused = await pair.counters(b)
    assert counters.get("connected") == 1 and a.did not in await b.connected(), counters
    # a replay follows the genuine record, which B took; a flipped record, or the first of
    # two swapped ones (it arrives after the later one failed), leaves nothing behind
    assert await b.holds(made["did"]) == (proxy.attack == "replay"), "B stored the attacked container"
    assert not any(k.startswith("peer_error_") for k in counters), counters  # nothing obeyed
    assert not any(k.startswith("strike_") for k in counters), counters  # a MITM gets nobody banned
    proxy.release.set()

    async def a_ended():
        return (await pair.counters(a))[0].get("disconnected", 0) >= 1

    await wait_for(a_ended, 20, "A's side of the session to end")


async def test_a_flipped_bit_in_a_record_ends_the_session(pair):
    pair.proxy.arm("flip")
    await _attacked_session_ends(pair, "bad_record")


async def test_a_replayed_record_ends_the_session(pair):
    pair.proxy.arm("replay")
    await _attacked_session_ends(pair, "bad_record")


async def test_two_records_swapped_end_the_session(pair):
    pair.proxy.arm("reorder")
    await _attacked_session_ends(pair, "bad_record")


@pytest.mark.parametrize("as_record", [False, True], ids=["text_message", "binary_unit"])
async def test_an_injected_error_frame_is_never_obeyed(pair, as_record):
    """A v1 error frame (cleartext JSON), as a text message or as a binary unit
    (u16be length || the JSON): not a record of the session, so it ends the session;
    never counted as B's peer reporting an error."""
    frame = orjson.dumps({"type": "error", "reason": "banned", "detail": "this node is ignored for a while"})
    if as_record:
        pair.proxy.inject(ws_frame(0x2, len(frame).to_bytes(2, "big") + frame, masked=True))
    else:
        pair.proxy.inject(ws_frame(0x1, frame, masked=True))
    b = pair.b

    async def ended():  # or took the frame as its peer's (v1 counted it: peer_error_banned)
        counters, _ = await pair.counters(b)
        return counters.get("disconnected", 0) >= 1 or any(k.startswith("peer_error_") for k in counters)

    await wait_for(ended, 20, "B to end the session (or to take the injected frame)")
    counters, refused = await pair.counters(b)
    assert not any(k.startswith("peer_error_") for k in counters), counters
    assert refused.get("peer:bad_record" if as_record else "peer:text_message", 0) == 1, refused
    assert "banned" not in counters and not any(k.startswith("strike_") for k in counters), counters
    pair.proxy.release.set()


async def test_a_second_dial_by_the_same_side_keeps_the_smaller_handshake_hash(nodes, tmp_path):
    """docs/protocol.md 21.3: a peer dials the node twice with the same DID. The connection
    with the smaller Noise handshake hash survives, whichever came first and whichever DID
    is the smaller: the old one is closed, or the new one is refused inside the channel
    (`duplicate_connection`: the responder's verdict, so the peer knows). Both ends know both
    hashes, so both keep the same one (before, each end kept the connection that completed
    last on its side, which could differ: both closed)."""
    import aiohttp

    from hmpnode.identity import Identity
    from tests.peerclient import PeerSocket, authenticate, closed_reason

    node = MeshNode(nodes(tmp_path / "n", env=mesh_env(**_NO_DISCOVERY)))
    port = node.info["peer"]["port"]
    seen, refused = set(), 0
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(24):  # each outcome is one draw in two: both are seen long before
                identity = Identity.generate()
                hashes: list[bytes] = []
                first = await authenticate(http, port, identity, hashes=hashes)
                assert isinstance(first, PeerSocket), first
                second = await authenticate(http, port, identity, hashes=hashes)
                if hashes[1] < hashes[0]:  # the new one is kept, the old one closed
                    assert isinstance(second, PeerSocket), second
                    assert await closed_reason(first, wait=5) == "closed" and await closed_reason(second) is None
                    await second.close()
                    seen.add("new")
                else:  # the old one is kept, the new one refused
                    assert second == "duplicate_connection"
                    assert await closed_reason(first) is None
                    refused += 1
                    seen.add("old")
                await first.close()
                if seen == {"new", "old"} and len(hashes) > 1:
                    break
        assert seen == {"new", "old"}
        counters = (await node.client.status())["mesh"]["counters"]
        assert counters.get("duplicate_connection") == refused, counters
    finally:
        await node.close()


async def test_only_peers_that_list_a_protocol_we_speak_are_dialled(nodes, tmp_path):
    """docs/protocol.md 21.6: two LAN announces name two listening loopback ports; the one
    without `protocols` (a v1 peer) is never dialled, the one listing hmp-peer/2 is."""
    import socket

    from hmpnode.container.verify import encode_wire
    from hmpnode.identity import Identity
    from hmpnode.net.announce import build_peer_announce
    from hmpnode.net.lan import utc_now
    from tests.nodeproc import LOOPBACK_MESH

    hits = {"v1": 0, "v2": 0}

    def listener(name):
        async def on_connect(reader, writer):
            hits[name] += 1
            writer.close()
        return on_connect

    servers = {name: await asyncio.start_server(listener(name), "127.0.0.1", 0) for name in hits}
    ports = {name: s.sockets[0].getsockname()[1] for name, s in servers.items()}
    node = MeshNode(nodes(tmp_path / "n", env=mesh_env(HMPNODE_PEER_DHT="false", HMPNODE_PEER_MIN_DIFFICULTY="1")))
    try:
        v1, v2 = Identity.generate(), Identity.generate()
        lan_port = int(LOOPBACK_MESH["HMPNODE_PEER_DISCOVERY_PORT"])

        async def dialled():
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
                for identity, name, protocols in ((v1, "v1", None), (v2, "v2", ["hmp-peer/2"])):
                    announce = build_peer_announce(identity, addresses=[f"tcp://127.0.0.1:{ports[name]}"],
                                                   now=utc_now(), difficulty=1, protocols=protocols)
                    s.sendto(encode_wire(announce), ("127.255.255.255", lan_port))
            return hits["v2"] >= 2  # dialled, and again after the failed handshake

        await wait_for(dialled, 30, "the node to dial the v2 peer", every=0.5)
        refused = (await node.client.status())["refused"]
        assert hits["v1"] == 0 and refused.get("dial:no_common_protocol", 0) >= 1, (hits, refused)
    finally:
        await node.close()
        for server in servers.values():
            server.close()


async def test_a_peer_pointing_the_node_at_itself_meets_self_connection(nodes, tmp_path):
    """A made-up peer announces the node's own peer address; the node dials that DID
    there, reaches itself and stops at message 2 (its own static key: self_connection,
    before revealing anything), counted; no session with itself. (Kept from v1, where the
    same case was the node's own DID in the hello.)"""
    import aiohttp

    from hmpnode.identity import Identity
    from tests.peerclient import PeerSocket, authenticate

    node = MeshNode(nodes(tmp_path / "n", env=mesh_env(**_NO_DISCOVERY)))
    port = node.info["peer"]["port"]
    try:
        async with aiohttp.ClientSession() as http:
            ws = await authenticate(http, port, Identity.generate(), addresses=[f"tcp://127.0.0.1:{port}"])
            assert isinstance(ws, PeerSocket), ws
            await ws.close()

        async def refused():
            status = await node.client.status()
            return status["refused"].get("peer_handshake:self_connection", 0) >= 1 and status

        status = await wait_for(refused, 20, "the node to dial itself and stop")
        assert status["mesh"]["counters"].get("handshake_self_connection", 0) >= 1
        assert node.did not in await node.connected()
    finally:
        await node.close()
