"""Directed delivery on real nodes when one step is lost on a connection that stays up
(docs/protocol.md 22.2, 24.2): the relay offers again what a connected recipient did not
acknowledge, the recipient forgets requests that were not answered, and nothing needs a
reconnection. Made-up peers (tests/peerclient.py) play the side that loses the step; the
node under test is real. On the old code each of these stalled until a reconnection
(which never comes here): the waits below ran out.

The decisions alone (the relay's re-offer, a request's expiry, one request per container
across relays, a holding that ends while its recipient is connected) are tested without
processes in tests/test_core.py; what stays here needs a real node: a response that omits
one, a full disk, the log of refused frames."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import pytest

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from hmpnode.identity.keystore import save_keystore
from tests.meshutil import MeshNode, mesh_env, wait_for
from tests.peerclient import authenticate
from tests.test_mesh_hostile import _Hostile, _incoming

#: short deadlines, so that a test waits seconds, not the defaults' 10-15 s
FAST = {"HMPNODE_RELAY_REOFFER_MS": "1000", "HMPNODE_PEER_REQUEST_TIMEOUT_MS": "800"}
ALONE = {"HMPNODE_PEER_LAN_DISCOVERY": "false", "HMPNODE_PEER_DHT": "false", "HMPNODE_PEER_TARGET_PEERS": "0"}


def _mail(author: Identity, recipient: str, n: int, tag: str = "m") -> list[dict]:
    now = datetime.now(timezone.utc).replace(microsecond=0)
    return [build_container(author, "note", {"n": i, "tag": tag}, now=now, recipients=[recipient]) for i in range(n)]


def _did(container: dict) -> str:
    return container["hmp_container"]["head"]["container_did"]


async def _next(peer: _Hostile, kinds: set[str], timeout: float) -> tuple[str, object] | None:
    """The next message of one of `kinds` the node sends (others are skipped), or None."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        try:
            msg = await peer.ws.receive(timeout=left)
        except (TimeoutError, asyncio.TimeoutError):
            return None
        if msg.type != aiohttp.WSMsgType.TEXT:
            return None
        kind, value = _incoming(msg.data)
        if kind in kinds:
            return kind, value
    return None


async def _connect(http, node: MeshNode, identity: Identity) -> _Hostile:
    ws = await authenticate(http, node.info["peer"]["port"], identity)
    assert not isinstance(ws, (int, str)), ws
    return _Hostile(node, identity, ws)


async def _hand_to_relay(http, relay: MeshNode, mail: list[dict]) -> None:
    """A made-up sender hands directed mail to the relay, which holds it."""
    sender = await _connect(http, relay, Identity.generate())
    await sender.send({"type": "containers", "items": mail})
    reply = await _next(sender, {"container_ack"}, 20)
    assert reply is not None and sorted(reply[1]["acknowledged"]) == sorted(map(_did, mail)), reply
    await sender.ws.close()


async def _held(relay: MeshNode) -> int:
    return (await relay.client.status())["mesh"]["relay"]["held"]


async def _zero(relay: MeshNode) -> bool:
    return await _held(relay) == 0


class _Recipient:
    """A real recipient node whose identity the test knows, and made-up relays offering to it."""

    def __init__(self, nodes, tmp_path: Path, **env: str):
        self.identity = Identity.generate()
        (tmp_path / "recipient").mkdir(mode=0o700)
        save_keystore(tmp_path / "recipient" / "identity.json", self.identity)
        self.node = MeshNode(nodes(tmp_path / "recipient", env=mesh_env(**env)))

    async def relay(self, http) -> _Hostile:
        me = Identity.generate()
        ws = await authenticate(http, self.node.info["peer"]["port"], me, addresses=["tcp://127.0.0.1:9"])
        assert not isinstance(ws, (int, str)), ws
        peer = _Hostile(self.node, me, ws)
        return peer

    async def offer(self, relay: _Hostile, mail: list[dict], timeout: float = 15) -> set[str]:
        """The relay offers `mail` (as a relay's delta, 24.2): what the node asks for."""
        from hmpnode.net.mce import index_entry

        added = {_did(m): index_entry(m["hmp_container"]) for m in mail}
        await relay.send_mce("container_delta", {"since": "2026-11-29T10:00:00Z", "added": added})
        asked = await _next(relay, {"container_request"}, timeout)
        return set(asked[1].get("request_container", [])) if asked else set()

    async def holds_all(self, mail: list[dict]) -> bool:
        return all([await self.node.holds(_did(m)) for m in mail])


async def test_what_a_response_omitted_is_asked_for_at_the_next_offer(nodes, tmp_path):
    """The relay's container_response lists fewer than were asked; the missing one is asked
    for at once when offered again (before: it stayed 'in flight' for 10 s and nothing
    offered it again)."""
    recipient = _Recipient(nodes, tmp_path, **ALONE)  # the default 10 s request timeout
    mail = _mail(Identity.generate(), recipient.identity.did, 3)
    try:
        async with aiohttp.ClientSession() as http:
            relay = await recipient.relay(http)
            assert await recipient.offer(relay, mail) == set(map(_did, mail))
            given = mail[1:]
            await relay.send_mce("container_response", {"available": [
                {"container_did": _did(m), "signature": m["hmp_container"]["head"]["signature"]} for m in given]})
            await relay.send({"type": "containers", "items": given})
            await wait_for(lambda: recipient.holds_all(given), 20, "what was given at the recipient")
            assert await recipient.offer(relay, mail[:1], timeout=5) == {_did(mail[0])}, "the omitted one not asked"
            await relay.send({"type": "containers", "items": mail[:1]})
            await wait_for(lambda: recipient.holds_all(mail), 20, "all the mail at the recipient")
            counters = (await recipient.node.client.status())["mesh"]["counters"]
            assert counters["requests_omitted"] == 1
            await relay.ws.close()
    finally:
        await recipient.node.close()


@contextlib.contextmanager
def _small_disk(path: Path, mib: int):
    """A tmpfs of `mib` MiB at `path` (root only: CI runs as root)."""
    path.mkdir(mode=0o700)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mib}m,mode=0700", "tmpfs", str(path)],
                          capture_output=True)
    if done.returncode != 0:
        if os.environ.get("HMPNODE_REQUIRE_NETNS"):
            raise AssertionError(f"cannot mount a tmpfs: {done.stderr.decode().strip()}")
        pytest.skip(f"cannot mount a tmpfs (root only): {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(path: Path) -> Path:
    """Take every free byte of the file system at `path`; the ballast file."""
    ballast = path / "ballast"
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        for size in (1 << 20, 1 << 12, 1):
            block = b"\0" * size
            for _ in range(1 << 16):  # bounded: the file system is a few MiB
                try:
                    os.write(fd, block)
                except OSError:
                    break
    finally:
        os.close(fd)
    return ballast


async def test_a_batch_refused_for_a_full_disk_is_delivered_once_room_is_back(nodes, tmp_path):
    """The recipient's disk is full when the relay hands it mail: it refuses the batch
    `storage_full` (nothing stored, nothing acknowledged). Before: neither side had anything
    outstanding and nothing acted again until a reconnection. Now the relay offers it again,
    and once room is back the mail is delivered, exactly once, over the same connection."""
    with _small_disk(tmp_path / "disk", 48) as disk:
        identity = Identity.generate()
        save_keystore(disk / "identity.json", identity)
        env = mesh_env(**FAST, HMPNODE_PEER_DHT="false")
        recipient = MeshNode(nodes(disk, env=env))
        relay = MeshNode(nodes(tmp_path / "relay", "--roles", "relay", env=env))
        mail = _mail(Identity.generate(), identity.did, 5)
        ballast = None
        try:
            await wait_for(lambda: _linked(recipient, relay), 30, "the recipient and the relay to connect")
            ballast = _fill(disk)
            async with aiohttp.ClientSession() as http:
                await _hand_to_relay(http, relay, mail)

            async def refused():
                counters = (await relay.client.status())["mesh"]["counters"]
                return counters.get("peer_rejected_storage_full", 0) >= 5

            await wait_for(refused, 30, "the recipient to refuse the mail storage_full")
            assert not await recipient.holds(_did(mail[0]))
            ballast.unlink()
            ballast = None
            await wait_for(lambda: _holds_all(recipient, mail), 30, "the mail at the recipient once room is back")
            await wait_for(lambda: _zero(relay), 20, "the relay to let go of it")
            status = await recipient.client.status()
            assert status["ingest"]["ingest_stored"] == 5  # exactly once
            assert status["mesh"]["counters"]["connected"] == 1  # the same connection throughout
        finally:
            if ballast is not None:
                ballast.unlink(missing_ok=True)
            await relay.close()
            await recipient.close()
            recipient.proc.stop()


async def _linked(a: MeshNode, b: MeshNode) -> bool:
    return b.did in await a.connected()


async def _holds_all(node: MeshNode, mail: list[dict]) -> bool:
    return all([await node.holds(_did(m)) for m in mail])


async def test_refused_frames_are_logged_once_in_a_while_with_their_reason(nodes, tmp_path):
    """A frame the node refuses while the session goes on (here: over peer.frames_per_second)
    is dropped: the log says so, with the peer and the reason, at most once a minute per peer
    and reason (before: nothing, and a stalled run's log looked clean)."""
    node = MeshNode(nodes(tmp_path / "n", env=mesh_env(HMPNODE_PEER_FRAMES_PER_SECOND="1", **ALONE)))
    try:
        async with aiohttp.ClientSession() as http:
            peer = await _connect(http, node, Identity.generate())
            for _ in range(24):  # a burst of 5 is allowed; 19 refused (2 strikes each, 38 < 50: not cut off)
                await peer.send({"type": "error", "reason": "rate_limited", "detail": ""})

            async def counted():
                counters = (await node.client.status())["mesh"]["counters"]
                return counters.get("strike_rate_limited", 0) >= 15 and "banned" not in counters

            await wait_for(counted, 20, "the refusals to be counted")
            await peer.ws.close()
        lines = [line for line in node.proc.log().splitlines() if "frame refused, rate_limited" in line]
        assert len(lines) == 1, lines
        assert peer.identity.did in lines[0] and "strikes of 50" in lines[0]
    finally:
        await node.close()
