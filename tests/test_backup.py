"""`hmpnode backup`, `hmpnode export` and `hmpnode import` against real node processes."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import sys
from datetime import datetime, timezone

import orjson

from hmpnode.container.build import build_container
from hmpnode.identity import Identity
from tests.meshutil import MeshNode
from tests.nodeproc import hmp, node_env


async def _held(node: MeshNode) -> dict[str, dict]:
    return {item["did"]: item async for item in node.client.iterate(expired="any")}


async def _fill(node: MeshNode) -> list[str]:
    """Containers of every kind a node holds: its own (plain, encrypted, linked), one
    signed elsewhere, evaluations of both."""
    stranger = Identity(bytes([9]) * 32)
    dids = []
    for i in range(5):
        dids.append((await node.client.create("diary_entry", {"title": f"t{i}", "content": "c" * i}))["did"])
    secret = await node.client.create("note", {"text": "for me"},
                                      encrypt_for=[{"public_key": node.public_key, "did": node.did}])
    linked = await node.client.create("note", {"text": "reply"}, related={"in_reply_to": [dids[0]]})
    foreign = build_container(stranger, "diary_entry", {"title": "x", "content": "y"},
                              now=datetime.now(timezone.utc).replace(microsecond=0))
    assert (await node.client.import_containers([foreign]))["stored"] == 1
    foreign_did = foreign["hmp_container"]["head"]["container_did"]
    await node.client.evaluate(dids[1], "relevance", 0.75)
    await node.client.evaluate(foreign_did, "accuracy", 0.25)
    return dids + [secret["did"], linked["did"], foreign_did]


async def test_export_then_import_into_a_fresh_node_gives_the_same_containers(nodes, tmp_path):
    a = MeshNode(nodes(tmp_path / "a"))
    b = MeshNode(nodes(tmp_path / "b"))
    try:
        dids = await _fill(a)
        dump = tmp_path / "a.jsonl"
        out = hmp("export", "--data-dir", str(tmp_path / "a"), "--out", str(dump))
        assert out.returncode == 0, out.stderr
        lines = dump.read_bytes().splitlines()
        assert [orjson.loads(x)["did"] for x in lines] == dids  # oldest first, all of them
        assert hmp("export", "--data-dir", str(tmp_path / "a"), "--out", str(dump)).returncode == 2  # never overwrites

        done = hmp("import", "--data-dir", str(tmp_path / "b"), str(dump))
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout) == {"read": len(dids), "stored": len(dids), "duplicate": 0, "conflict": 0,
                                           "rejected": 0}
        before, after = await _held(a), await _held(b)
        assert list(after) == list(before) == dids  # same containers, same order
        for did in dids:
            assert after[did]["container"]["hmp_container"] == before[did]["container"]["hmp_container"]
            assert after[did]["container"].get("evaluations") == before[did]["container"].get("evaluations")
        assert (await b.client.evaluations(dids[1]))["items"] == (await a.client.evaluations(dids[1]))["items"]
        # backlinks: the same links (each node signs its own block)
        links = (await a.client.referenced_by(dids[0]))["links"]
        assert len(links) == 1 and (await b.client.referenced_by(dids[0]))["links"] == links

        # again: nothing new; a bad line, a tampered container: reported by line, exit 1, the rest taken
        tampered = orjson.loads(lines[2])
        tampered["container"]["hmp_container"]["payload"] = {"title": "forged", "content": "c"}
        # with another signature too: a held (DID, signature) pair is answered duplicate unverified
        # (docs/protocol.md#rule-duplicate-before-verification), a forgery under a new signature
        # is verified and refused
        head = tampered["container"]["hmp_container"]["head"]
        head["signature"] = ("B" if head["signature"][0] != "B" else "C") + head["signature"][1:]
        dump.write_bytes(b"\n".join([lines[0], b"{not json", orjson.dumps(tampered), b"", b"[1]"]) + b"\n")
        again = hmp("import", "--data-dir", str(tmp_path / "b"), str(dump))
        assert again.returncode == 1
        assert json.loads(again.stdout) == {"read": 4, "stored": 0, "duplicate": 1, "conflict": 0, "rejected": 3}
        errors = again.stderr.decode().splitlines()
        assert errors[0].startswith("hmpnode: line 2: bad_line: not JSON")
        assert errors[1].startswith("hmpnode: line 5: bad_line: neither")
        assert errors[2].startswith("hmpnode: line 3: ") and dids[2] in errors[2] and "bad_line" not in errors[2]
        assert len(await _held(b)) == len(dids)
    finally:
        await a.close()
        await b.close()


async def test_backup_while_writing_is_consistent_and_a_node_starts_from_it(nodes, tmp_path):
    a = MeshNode(nodes(tmp_path / "a"))
    stop = asyncio.Event()
    written: list[str] = []

    async def write() -> None:
        i = 0
        while not stop.is_set() and i < 5000:
            written.append((await a.client.create("diary_entry", {"title": f"w{i}", "content": "x" * 200}))["did"])
            i += 1

    writer = asyncio.create_task(write())
    try:
        while len(written) < 50 and not writer.done():
            await asyncio.sleep(0.05)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "hmpnode", "backup", "--data-dir", str(tmp_path / "a"), str(tmp_path / "copy"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=node_env())
        stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
        during = len(written)
        assert proc.returncode == 0, stderr
        report = json.loads(stdout)
    finally:
        stop.set()
        await asyncio.wait_for(writer, 60)
    try:
        assert len(written) > during or report["containers"] < len(written)  # the node went on writing
        copy = tmp_path / "copy"
        assert sorted(report["files"]) == ["hmpnode.sqlite3", "identity.json"]
        assert (copy.stat().st_mode & 0o777) == 0o700 and (copy / "hmpnode.sqlite3").stat().st_mode & 0o077 == 0
        with sqlite3.connect(copy / "hmpnode.sqlite3") as conn:
            assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"
        # a node starts from the copy: the same agent, exactly the first N containers written
        b = MeshNode(nodes(copy))
        try:
            assert b.did == a.did
            held = list(await _held(b))
            assert len(held) == report["containers"] >= 50
            assert held == written[: len(held)]
        finally:
            await b.close()
        # a second backup into the same place is refused, as is a data dir with no store
        again = hmp("backup", "--data-dir", str(tmp_path / "a"), str(copy))
        assert again.returncode == 2 and b"exists" in again.stderr  # as export --out that exists
        empty = hmp("backup", "--data-dir", str(tmp_path / "none"), str(tmp_path / "copy2"))
        assert empty.returncode == 1 and b"no store" in empty.stderr
    finally:
        await a.close()


def test_read_lines_bounds_each_line_and_parse_lines_reports_what_is_no_container():
    import io

    from hmpnode.backup import ImportReport, batches, parse_lines, read_lines

    data = b'{"hmp_container": {"a": 1}}\n' + b"x" * 100 + b"\n" + b"\n" + b'{"container": {"hmp_container": 2}}'
    lines = list(read_lines(io.BytesIO(data), 40))
    assert lines == [b'{"hmp_container": {"a": 1}}\n', b"\0", b"\n", b'{"container": {"hmp_container": 2}}']
    report = ImportReport()
    taken = list(parse_lines(lines, report))
    assert [n for n, _ in taken] == [1, 4] and orjson.loads(taken[1][1]) == {"hmp_container": 2}
    assert report.to_json() == {"read": 3, "stored": 0, "duplicate": 0, "conflict": 0, "rejected": 1}
    assert report.problems[0][:3] == (2, None, "bad_line")
    # batches: by count, and by bytes (a larger item goes alone)
    items = [(i, b"x" * size) for i, size in enumerate([10, 10, 10, 50, 10])]
    assert [[n for n, _ in b] for b in batches(items, count=2, size=30)] == [[0, 1], [2], [3], [4]]
