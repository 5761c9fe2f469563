"""The `hmpnode` command line. A thin shell over the sans-IO core (keygen,
container ...), the daemon (`run`, in hmpnode.daemon) and the agent API client
(status, send, get, list, evaluate, propose, vote, consensus, trust, watch, wait, id, stop, log-level: they
find the running node through <data-dir>/node.json and api.token). Every failure is one line on stderr
and an exit code (EXIT_CODES: 0 success, 1 rejected / failed / no node / nothing
known, 2 usage, unreadable input or a value the node calls malformed, 3 `stop` timed out,
130 Ctrl-C)."""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import textwrap
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any, NoReturn

import nacl.utils
import orjson

from hmpnode import __version__
from hmpnode.container import compression as _compression
from hmpnode.container.backlinks import read_links
from hmpnode.container.build import Recipient, build_container
from hmpnode.container.encoding import EncodingError, format_time, parse_moment
from hmpnode.container.payload import PayloadError, open_payload, parse_payload_type, recipients_of
from hmpnode.container.verify import Verifier, encode_wire, parse_container
from hmpnode.identity import (
    Identity,
    KeystoreError,
    MemoryKeyRegistry,
    agent_did_for_key,
    load_keystore,
    public_key_from_b58,
    save_keystore,
)
from hmpnode.identity.keystore import read_passphrase_file

EXIT_OK, EXIT_REJECTED, EXIT_USAGE, EXIT_STILL_RUNNING, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_CODES = """exit codes:
  0  success
  1  refused, rejected or failed: an invalid container, a node refusal, no node running
     on the data dir (`restore`: a node running on it), `wait` timed out, nothing
     recalled, no evaluations to judge an agent's trust by
  2  usage: a bad flag or value (one the node answers 400 to as well), an unreadable or
     unsafe file, invalid settings; `run`: a busy port, a lock or store it cannot use
     (not a database, damaged, unreadable, a newer hmpnode's): starting again cannot help;
     `restore`: a backup refused (another agent's, unsound, newer, older than the record)
  3  `stop`: the node still runs when --timeout passes
  130  interrupted (Ctrl-C); `run` stops on SIGINT or SIGTERM with 0, `watch` on SIGTERM"""
MAX_INPUT_BYTES = 64 * 1024 * 1024
#: the class `hmpnode remember` (and the MCP tool) writes: free text, not one of the spec's
MEMORY_CLASS = "note"
#: seconds `hmpnode stop` waits by default for the node to be gone: it first lets in-flight
#: requests finish (daemon.SHUTDOWN_TIMEOUT), then drains queued writes
STOP_TIMEOUT = 60.0
#: seconds `hmpnode wait` waits by default: a first start (new identity, store) takes a few
#: seconds, more on a loaded machine
WAIT_TIMEOUT = 60.0


class CliError(Exception):
    def __init__(self, message: str, code: int = EXIT_USAGE):
        super().__init__(message)
        self.code = code


def _now() -> datetime:
    return datetime.now(timezone.utc).replace(microsecond=0)


def _print_json(value: Any, *, pretty: bool = False) -> None:
    option = orjson.OPT_INDENT_2 if pretty else 0
    sys.stdout.write(orjson.dumps(value, option=option).decode() + "\n")


def _read_input(name: str) -> bytes:
    try:
        if name == "-":
            data = sys.stdin.buffer.read(MAX_INPUT_BYTES + 1)
        else:
            with open(name, "rb") as fh:
                data = fh.read(MAX_INPUT_BYTES + 1)
    except OSError as exc:
        raise CliError(f"cannot read {name}: {exc.strerror or exc}") from None
    if len(data) > MAX_INPUT_BYTES:
        raise CliError(f"{name} is larger than {MAX_INPUT_BYTES} bytes")
    return data


def _read_passphrase(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        return read_passphrase_file(path)
    except KeystoreError as exc:
        raise CliError(str(exc)) from None


def _load_identity(args: argparse.Namespace) -> Identity:
    try:
        return load_keystore(args.key, passphrase=_read_passphrase(args.passphrase_file))
    except KeystoreError as exc:
        raise CliError(f"{args.key}: {exc}") from None


def _parse_moment(text: str, now: datetime, flag: str = "--ttl") -> datetime:
    """RFC 3339 UTC time, or a duration from now: 90s, 30m, 12h, 7d (encoding.parse_moment)."""
    try:
        return parse_moment(text, now)
    except EncodingError as exc:
        raise CliError(f"{flag} {text!r}: {exc}") from None


def _parse_recipient(text: str) -> Recipient:
    """PUBLIC_KEY (self-certifying DID derived) or DID=PUBLIC_KEY."""
    did, sep, key_text = text.rpartition("=")
    try:
        key = public_key_from_b58(key_text)
    except EncodingError:
        raise CliError(f"--to {text!r}: not a base58btc Ed25519 public key") from None
    return Recipient(did if sep else agent_did_for_key(key), key)


def _parse_related(items: list[str]) -> dict[str, list[str]] | None:
    if not items:
        return None
    related: dict[str, list[str]] = {}
    for item in items:
        relation, sep, did = item.partition("=")
        if not sep or not relation or not did.startswith("did:"):
            raise CliError(f"--related {item!r}: expected TYPE=DID, e.g. in_reply_to=did:hmp:container:Qm...")
        related.setdefault(relation, []).append(did)
    return related


def _known_classes() -> list[str]:
    """The classes the node has a payload schema for (schemas/classes), and MEMORY_CLASS."""
    from hmpnode.container.schema import default_schemas

    return sorted({*default_schemas().known_classes, MEMORY_CLASS})


def _check_class(args: argparse.Namespace) -> None:
    """A misspelt --class would be signed, stored and gossiped: refuse what the node has no
    schema for unless the user says it is meant (spec 3.5: unknown classes are legal, kept
    and passed on)."""
    if args.class_ not in _known_classes() and not args.allow_unknown_class:
        raise CliError(f"--class {args.class_!r} is not a known class (see --help); "
                       "pass --allow-unknown-class if it is meant")


def _class_help(what: str) -> str:
    return f"{what}: one of {', '.join(_known_classes())} (others need --allow-unknown-class)"


def _load_json_arg(name: str, what: str) -> Any:
    try:
        return orjson.loads(_read_input(name))
    except orjson.JSONDecodeError as exc:
        raise CliError(f"{what} {name}: not JSON ({exc})") from None


# -- commands ---------------------------------------------------------------


def cmd_keygen(args: argparse.Namespace) -> int:
    identity = Identity.generate()
    out = Path(args.out)
    try:
        save_keystore(out, identity, passphrase=_read_passphrase(args.passphrase_file), overwrite=args.force)
    except FileExistsError:
        raise CliError(f"{out} exists; pass --force to replace it") from None
    except (OSError, ValueError) as exc:
        raise CliError(f"cannot write {out}: {exc}") from None
    _print_json({"did": identity.did, "public_key": identity.public_key_b58, "keystore": str(out)})
    return EXIT_OK


def cmd_build(args: argparse.Namespace) -> int:
    _check_class(args)
    identity = _load_identity(args)
    now = _parse_moment(args.now, _now(), "--now") if args.now else _now()
    if args.payload is None:
        payload: Any = {}
    else:
        payload = _load_json_arg(args.payload, "--payload")
    if not isinstance(payload, dict):
        raise CliError("--payload must hold a JSON object (spec 3.5)")
    recipients = [_parse_recipient(t) for t in args.to]
    meta = _load_json_arg(args.meta, "--meta") if args.meta else None
    if meta is not None and not isinstance(meta, dict):
        raise CliError("--meta must hold a JSON object")
    if args.confidence is not None and not 0 <= args.confidence <= 1:
        raise CliError("--confidence must be within 0..1")
    try:
        container = build_container(
            identity,
            args.class_,
            payload,
            now=now,
            rng=nacl.utils.random,
            subclass=args.subclass,
            tags=args.tag or None,
            ttl=_parse_moment(args.ttl, now) if args.ttl else None,
            encrypt_to=recipients or None,
            compression=args.compress,
            broadcast=True if args.broadcast else None,
            network=args.network,
            confidence=args.confidence,
            meta=meta,
            related=_parse_related(args.related),
        )
    except ValueError as exc:
        raise CliError(str(exc), EXIT_REJECTED) from None
    # Verify what we made before handing it out: a bad --class, --network or
    # payload is reported here rather than by the first node that sees it.
    result = Verifier().verify(container, now=now)
    if not result.ok:
        raise CliError(f"built container does not verify: {result.reason}: {result.detail}", EXIT_REJECTED)
    if args.pretty:
        _print_json(container, pretty=True)
    else:
        sys.stdout.write(encode_wire(container).decode() + "\n")
    return EXIT_OK


def _registry_from_pins(pins: list[str]) -> MemoryKeyRegistry:
    registry = MemoryKeyRegistry()
    for pin in pins:
        did, sep, key_text = pin.rpartition("=")
        try:
            if not sep:
                raise EncodingError("missing =")
            registry.pin(did, public_key_from_b58(key_text))
        except EncodingError:
            raise CliError(f"--pin {pin!r}: expected DID=BASE58_PUBLIC_KEY") from None
    return registry


def cmd_verify(args: argparse.Namespace) -> int:
    raw = _read_input(args.file)
    now = _parse_moment(args.now, _now(), "--now") if args.now else _now()
    result = Verifier(registry=_registry_from_pins(args.pin)).verify(raw, now=now)
    _print_json(result.to_json())
    return EXIT_OK if result.ok else EXIT_REJECTED


def cmd_decrypt(args: argparse.Namespace) -> int:
    identity = _load_identity(args)
    raw = _read_input(args.file)
    result = Verifier().verify(raw, now=_now())
    if not result.ok:
        raise CliError(f"container rejected: {result.reason}: {result.detail}", EXIT_REJECTED)
    try:
        payload = open_payload(result.container["hmp_container"], identity)
    except PayloadError as exc:
        raise CliError(f"{exc.code}: {exc}", EXIT_REJECTED) from None
    if isinstance(payload, bytes):
        sys.stdout.buffer.write(payload)
    else:
        _print_json(payload, pretty=args.pretty)
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    raw = _read_input(args.file)
    try:
        container = parse_container(raw)
    except ValueError as exc:
        raise CliError(f"not a container: {exc}", EXIT_REJECTED) from None
    result = Verifier().verify(raw, now=_now())
    hmp = container["hmp_container"]
    head = hmp.get("head") if isinstance(hmp.get("head"), dict) else {}
    lines = [
        f"container  {head.get('container_did', '?')}",
        f"class      {head.get('class', '?')}" + (f" / {head['subclass']}" if head.get("subclass") else ""),
        f"sender     {head.get('sender_did', '?')}",
        f"time       {head.get('timestamp', '?')}" + (f"  (ttl {head['ttl']})" if head.get("ttl") else ""),
        f"size       {len(raw)} bytes on the wire",
        f"payload    {head.get('payload_type', '?')}, {head.get('payload_hash', '?')}",
    ]
    if head.get("tags"):
        lines.append(f"tags       {', '.join(map(str, head['tags']))}")
    scope = head.get("network", "")
    lines.append(f"scope      network={scope!r} broadcast={head.get('broadcast', False)}")
    try:
        encrypted = parse_payload_type(str(head.get("payload_type", "json"))).encrypted
    except ValueError:
        encrypted = False
    if encrypted:
        who = recipients_of(head)
        lines.append(f"encrypted  {head.get('encryption_algo', '?')} for {len(who)}: {', '.join(map(str, who))}")
    elif head.get("recipient"):
        lines.append(f"recipient  {', '.join(map(str, head['recipient']))}")
    related = hmp.get("related") if isinstance(hmp.get("related"), dict) else {}
    for relation, targets in related.items():
        for target in [targets] if isinstance(targets, str) else targets if isinstance(targets, list) else []:
            lines.append(f"link       {relation} -> {target}")
    backlinks = container.get("referenced-by")
    if isinstance(backlinks, dict):
        try:  # any of the link forms of spec 12.3
            count = str(len(read_links(backlinks.get("links"))))
        except ValueError:
            count = "unreadable"
        lines.append(f"backlinks  {count} (signed by {backlinks.get('peer_did', '?')})")
    evaluations = container.get("evaluations")
    if isinstance(evaluations, dict) and isinstance(evaluations.get("items"), list):
        lines.append(f"evaluated  {len(evaluations['items'])} item(s)")
    if result.ok:
        flags = [f"store-and-forward ({', '.join(sorted(result.store_and_forward))})"] if result.store_and_forward else []
        if result.expired:
            flags.append("EXPIRED")
        lines.append("valid      yes" + (f"; {'; '.join(flags)}" if flags else ""))
    else:
        lines.append(f"valid      NO: {result.reason}: {result.detail}")
    sys.stdout.write("\n".join(lines) + "\n")
    return EXIT_OK if result.ok else EXIT_REJECTED


# -- the daemon ---------------------------------------------------------------


def cmd_run(args: argparse.Namespace) -> int:
    from hmpnode import daemon

    options = daemon.RunOptions(
        data_dir=Path(args.data_dir).expanduser().absolute() if args.data_dir else None,
        config=Path(args.config).expanduser().absolute() if args.config else None,
        api_host=args.api_host,
        api_port=args.api_port,
        log_format=args.log_format,
        log_level=args.log_level,
        roles=args.roles,
        peer_host=args.peer_host,
        peer_port=args.peer_port,
        dht_port=args.dht_port,
        announce=args.announce,
        no_announce=args.no_announce,
        static=args.static,
        accept_store_loss=args.accept_store_loss,
    )
    try:
        return daemon.run(options)
    except daemon.DaemonError as exc:
        raise CliError(str(exc), exc.code) from None


def cmd_config(args: argparse.Namespace) -> int:
    """`config show`: the settings a node started here would run with, each with where it
    came from; `config check [FILE]`: whether FILE (default: the data dir's, with the
    environment) is valid: exit 2 naming the key and the reason."""
    from hmpnode.config import ConfigError, load_settings

    file = getattr(args, "file", None) or args.config
    sources: dict[str, str] = {}
    try:
        settings = load_settings(
            data_dir=Path(args.data_dir).expanduser().absolute() if args.data_dir else None,
            config_file=Path(file).expanduser().absolute() if file else None,
            env=os.environ, overrides={}, sources_out=sources)
    except ConfigError as exc:
        raise CliError(str(exc), EXIT_USAGE) from None
    if args.action == "check":
        used = sorted({s for s in sources.values() if s != "default"})
        _print_json({"ok": True, "data_dir": str(settings.data_dir), "from": used})
        return EXIT_OK
    _print_json({"data_dir": str(settings.data_dir), "settings": settings.shown(sources)}, pretty=args.pretty)
    return EXIT_OK


# -- client commands: talk to the running node ------------------------------


def _client_failure(exc: Exception, message: str | None = None) -> CliError:
    """A ClientError as one line (`message`, else its own): exit 2 for a data dir refused
    as unsafe (as `run` refuses it), else 1 (no node, a connection lost, an API refusal)."""
    from hmpnode.client import UnsafeDataDir

    return CliError(str(exc) if message is None else message,
                    EXIT_USAGE if isinstance(exc, UnsafeDataDir) else EXIT_REJECTED)


def _client(args: argparse.Namespace):
    from hmpnode.client import Client, ClientError

    try:
        return Client.from_data_dir(args.data_dir)
    except ClientError as exc:
        raise _client_failure(exc) from None


#: the API's field (or header) names in its error details, as the flags that set them
_FLAG_OF_FIELD = {
    "max_tokens": "--tokens", "max_bytes": "--bytes", "Last-Event-ID": "--cursor", "cursor": "--cursor",
    "limit": "--limit", "state": "--state", "value": "--value", "type": "--type", "target": "--target",
    "date": "--date", "sender": "--sender", "recipient": "--recipient", "related": "--related",
    "class": "--class", "subclass": "--subclass", "tag": "--tag", "tags": "--tag", "ttl": "--ttl",
    "network": "--network", "confidence": "--confidence", "meta": "--meta", "payload": "--payload",
    "encrypt_for": "--to", "recipients": "--to", "compression": "--compress", "order": "--order",
    "q": "QUERY", "query": "QUERY", "text": "TEXT", "title": "--title", "did": "DID",
}


def _as_flags(detail: str) -> str:
    """`max_tokens: must be ...` -> `--tokens: must be ...`: name what the user typed.
    Only a field followed by ": " is one (`did:hmp:agent:... is not ...` starts with a DID)."""
    field, sep, rest = detail.partition(":")
    name = field.split(".", 1)[0].split("[", 1)[0].strip()
    if sep and rest.startswith(" ") and name in _FLAG_OF_FIELD:
        return f"{_FLAG_OF_FIELD[name]}{field.strip()[len(name):]}:{rest}"
    return detail


def _call(args: argparse.Namespace, work) -> int:
    """Run `await work(client)` against the node on --data-dir; API and connection
    failures become one line: exit 2 for a request the node calls malformed (400: a
    flag's value it does not take), else exit 1."""
    from hmpnode.client import ApiError, ClientError

    async def main() -> int:
        async with _client(args) as client:
            return await work(client)

    try:
        return asyncio.run(main())
    except ApiError as exc:
        raise CliError(f"{exc.reason}: {_as_flags(exc.detail)}" if exc.detail else exc.reason,
                       EXIT_USAGE if exc.status == 400 else EXIT_REJECTED) from None
    except ClientError as exc:
        raise _client_failure(exc) from None


def cmd_wait(args: argparse.Namespace) -> int:
    """Until the node on --data-dir answers (prints its node.json), or --timeout: exit 1."""
    from hmpnode.client import Client, ClientError, UnsafeDataDir

    if not 0 < args.timeout <= 86400:
        raise CliError("--timeout must be within 0..86400 seconds")

    async def main() -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.timeout
        while True:
            left = deadline - loop.time()
            try:
                async with Client.from_data_dir(args.data_dir, timeout=max(0.5, min(5.0, left))) as client:
                    await client.status()
                    _print_json(client.node_info)
                    return EXIT_OK
            except UnsafeDataDir as exc:  # waiting will not make it safe
                raise _client_failure(exc) from None
            except ClientError as exc:
                problem = exc
            left = deadline - loop.time()
            if left <= 0:
                raise CliError(f"no node answered within {args.timeout:g} s: {problem}", EXIT_REJECTED)
            await asyncio.sleep(min(0.2, left))

    return asyncio.run(main())


def cmd_id(args: argparse.Namespace) -> int:
    from hmpnode.client import ClientError, read_node_file

    try:
        info, _ = read_node_file(args.data_dir)
    except ClientError as exc:
        raise _client_failure(exc) from None
    print(info["public_key"] if args.public_key else info["did"])
    return EXIT_OK


def _emit(value: Any) -> None:
    sys.stdout.write(orjson.dumps(value).decode() + "\n")
    sys.stdout.flush()


def cmd_status(args: argparse.Namespace) -> int:
    async def work(client) -> int:
        _print_json({"node": client.node_info, "status": await client.status()}, pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_search(args: argparse.Namespace) -> int:
    filters = {"class_": args.class_, "tag": args.tag, "sender": args.sender, "state": args.state,
               "limit": args.limit, "scope": args.scope}

    async def work(client) -> int:
        _print_json(await client.search(args.query, **filters), pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_remember(args: argparse.Namespace) -> int:
    text = sys.stdin.read() if args.text == "-" else args.text
    if not text.strip():
        raise CliError("nothing to remember: the text is empty")
    ttl = format_time(_parse_moment(args.ttl, _now())) if args.ttl else None  # a bad --ttl before the node is asked

    async def work(client) -> int:
        result = await client.create(MEMORY_CLASS, {"text": text}, tags=args.tag or None, ttl=ttl,
                                     source=args.source, scope=args.scope)
        _print_json({k: result[k] for k in ("did", "seq", "status") if k in result})
        return EXIT_OK

    return _call(args, work)


def cmd_recall(args: argparse.Namespace) -> int:
    if args.tokens < 1 or args.bytes < 1:
        raise CliError("--tokens and --bytes must be at least 1")
    options = {"include_contested": args.contested or None, "class": args.class_, "tag": args.tag,
               "scope": args.scope, "explain": args.explain or None, "why": args.why or None}

    async def work(client) -> int:
        envelope = await client.recall(args.query, max_tokens=args.tokens, max_bytes=args.bytes, **options)
        if args.explain:
            _print_json(envelope["explain"])
            return EXIT_OK if envelope["explain"].get("selected_count") else EXIT_REJECTED
        if args.why:
            _print_json(envelope, pretty=True)
        else:
            for item in envelope["items"]:
                _emit(item)
            if not envelope["items"]:
                print(f"hmpnode: nothing recalled ({envelope['abstain']})", file=sys.stderr)
        return EXIT_OK if envelope["items"] else EXIT_REJECTED

    return _call(args, work)


def cmd_forget(args: argparse.Namespace) -> int:
    given = {k: v for k, v in (("did", args.did), ("source", args.source), ("scope", args.scope)) if v is not None}
    if len(given) != 1:
        raise CliError("forget: give exactly one of a DID, --source or --scope")

    async def work(client) -> int:
        _print_json(await client.forget(**given))
        return EXIT_OK

    return _call(args, work)


def cmd_scope(args: argparse.Namespace) -> int:
    async def work(client) -> int:
        _print_json(await client.accept_into_scope(args.scope, args.did))
        return EXIT_OK

    return _call(args, work)


def cmd_journal(args: argparse.Namespace) -> int:
    if args.text is not None and args.action != "add":
        hint = " (the day goes in --date)" if args.action == "anchor" else ""
        raise CliError(f"journal {args.action} takes no text{hint}")

    async def work(client) -> int:
        if args.action == "add":
            text = sys.stdin.read() if args.text in (None, "-") else args.text
            _print_json(await client.journal_add(text, title=args.title, tags=args.tag or None))
        elif args.action == "verify":
            report = await client.journal_verify()
            _print_json(report, pretty=True)
            if not report["ok"]:
                problem = report["first_problem"]
                print(f"hmpnode: journal {problem['kind']} at entry {problem.get('index')}: {problem['container_did']}",
                      file=sys.stderr)
                return EXIT_REJECTED
        elif args.action == "load":
            for entry in (await client.journal_load(args.tokens, include_routine=args.routine))["entries"]:
                _emit(entry)
        else:  # anchor
            day = args.date or (_now() - timedelta(days=1)).date().isoformat()
            _print_json(await client.journal_anchor(day), pretty=True)
        return EXIT_OK

    return _call(args, work)


def cmd_mcp(args: argparse.Namespace) -> int:
    from hmpnode.client import ClientError

    try:
        from hmpnode.mcpserver import run
    except ImportError as exc:
        raise CliError(f"the MCP server needs the 'mcp' package: {exc}", EXIT_USAGE) from None
    try:
        return run(args.data_dir)
    except ClientError as exc:  # refused before serving: an MCP client shows this line to its user
        raise _client_failure(exc, f"mcp: not started: {exc} (name the node's data dir with --data-dir)") from None


def cmd_peers(args: argparse.Namespace) -> int:
    """Show the peers (no action), or list, add or remove the static peers."""
    if args.action in ("add", "remove") and args.spec is None:
        also = " or its DID" if args.action == "remove" else ""
        raise CliError(f"peers {args.action}: name the peer: tcp://host:port or did:...@tcp://host:port{also}")
    if args.action in (None, "list") and args.spec is not None:
        raise CliError("peers: a peer goes with add or remove")

    async def work(client) -> int:
        if args.action is None:
            out = await client.peers()
        elif args.action == "list":
            out = await client.static_peers()
        elif args.action == "add":
            out = await client.add_static_peer(args.spec)
        else:
            out = await client.remove_static_peer(args.spec)
        _print_json(out, pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_peer_index(args: argparse.Namespace) -> int:
    filters = {"class_": args.class_, "tag": args.tag, "sender": args.sender, "related": args.related,
               "relation": args.relation, "cursor": args.cursor, "limit": args.limit}

    async def work(client) -> int:
        _print_json(await client.peer_index(args.did, **filters), pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


#: written beside api.token by `dashboard --open`: the browser is handed this file, not
#: the URL, so that the token is not in its command line (any local user can read those)
DASHBOARD_OPENER = "dashboard-open.html"


def dashboard_url(data_dir: str | None) -> tuple[str, Path]:
    """(the dashboard's URL with the token in its fragment, the node's data dir)."""
    from urllib.parse import quote

    from hmpnode.client import ClientError, _default_data_dir, read_node_file

    directory = Path(data_dir).expanduser() if data_dir else _default_data_dir()
    try:
        info, token = read_node_file(directory)
    except ClientError as exc:
        raise _client_failure(exc) from None
    return f"{info['api']['url'].rstrip('/')}/#token={quote(token, safe='')}", directory


def cmd_dashboard(args: argparse.Namespace) -> int:
    import html
    import webbrowser

    from hmpnode.fsutil import write_private_file

    url, directory = dashboard_url(args.data_dir)
    print(url)
    if args.open:
        opener = directory / DASHBOARD_OPENER
        page = f'<!doctype html><meta http-equiv="refresh" content="0;url={html.escape(url)}"><title>hmpnode</title>\n'
        try:
            write_private_file(opener, page.encode("utf-8"), replace=True)
        except OSError as exc:
            raise CliError(f"cannot write {opener}: {exc.strerror or exc}", EXIT_REJECTED) from None
        if not webbrowser.open(opener.absolute().as_uri()):
            raise CliError("no web browser could be started; open the URL above", EXIT_REJECTED)
    return EXIT_OK


def _encrypt_for(text: str) -> dict[str, str]:
    """--to PUBLIC_KEY or DID=PUBLIC_KEY, as the API's encrypt_for item."""
    recipient = _parse_recipient(text)  # validates the key
    did, sep, key = text.rpartition("=")
    return {"public_key": key, "did": recipient.did} if sep else {"public_key": key}


def cmd_send(args: argparse.Namespace) -> int:
    _check_class(args)
    payload: Any = {} if args.payload is None else _load_json_arg(args.payload, "--payload")
    if not isinstance(payload, dict):
        raise CliError("--payload must hold a JSON object (spec 3.5)")
    meta = _load_json_arg(args.meta, "--meta") if args.meta else None
    if meta is not None and not isinstance(meta, dict):
        raise CliError("--meta must hold a JSON object")
    if args.confidence is not None and not 0 <= args.confidence <= 1:
        raise CliError("--confidence must be within 0..1")
    options: dict[str, Any] = {
        "subclass": args.subclass,
        "tags": args.tag or None,
        "ttl": format_time(_parse_moment(args.ttl, _now())) if args.ttl else None,
        "related": _parse_related(args.related),
        "encrypt_for": [_encrypt_for(t) for t in args.to] or None,
        "compression": args.compress,
        "network": args.network,
        "broadcast": True if args.broadcast else None,
        "meta": meta,
        "confidence": args.confidence,
    }

    async def work(client) -> int:
        made = await client.create(args.class_, payload, **options)
        if not args.full and isinstance(made, dict):
            made = {k: v for k, v in made.items() if k != "container"}
        _print_json(made, pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_get(args: argparse.Namespace) -> int:
    async def work(client) -> int:
        _print_json(await client.get(args.did, decrypt=args.decrypt), pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_versions(args: argparse.Namespace) -> int:
    async def work(client) -> int:
        _print_json(await client.versions(args.did, mesh=args.mesh), pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_list(args: argparse.Namespace) -> int:
    if args.limit is not None and args.limit < 1:
        raise CliError("--limit must be at least 1")
    filters = {"class_": args.class_, "tag": args.tag, "sender": args.sender, "recipient": args.recipient,
               "related": args.related, "order": args.order, "limit": args.limit, "cursor": args.cursor}

    async def work(client) -> int:
        if args.all:
            async for item in client.iterate(**filters):
                _emit(item)
        else:
            page = await client.list(**filters)
            for item in page.get("items") or ():
                _emit(item)
            if page.get("next_cursor") is not None:
                print(f"hmpnode: more: --cursor {page['next_cursor']} (or --all)", file=sys.stderr)
        return EXIT_OK

    return _call(args, work)


def cmd_evaluate(args: argparse.Namespace) -> int:
    from hmpnode.container.evaluations import EVALUATION_TYPES

    if args.type not in EVALUATION_TYPES and not args.allow_custom_type:
        raise CliError(f"--type {args.type!r} is not one of the spec's ({', '.join(EVALUATION_TYPES)}); "
                       "pass --allow-custom-type if it is meant")

    async def work(client) -> int:
        _print_json(await client.evaluate(args.did, args.type, args.value, target=args.target), pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_propose(args: argparse.Namespace) -> int:
    rules = {"ttl": args.ttl, "quorum": args.quorum, "threshold": args.threshold,
             "voters": args.voter or None, "weighting": args.weighting, "tags": args.tag or None}

    async def work(client) -> int:
        out = await client.propose(args.text, **rules)
        _print_json({k: out[k] for k in ("did", "seq", "status")} | {
            "deadline": out["container"]["hmp_container"]["head"].get("ttl")}, pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_vote(args: argparse.Namespace) -> int:
    value = {"yes": 1, "no": -1, "abstain": 0}.get(args.value)
    if value is None:
        try:
            value = float(args.value)
        except ValueError:
            raise CliError(f"vote value {args.value!r}: give yes, no, abstain or a number in [-1, 1]") from None

    async def work(client) -> int:
        out = await client.vote(args.did, value, type=args.type, reason=args.reason)
        _print_json({k: out[k] for k in ("did", "seq", "status")}, pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_consensus(args: argparse.Namespace) -> int:
    async def work(client) -> int:
        _print_json(await client.consensus(args.did), pretty=args.pretty)
        return EXIT_OK

    return _call(args, work)


def cmd_trust(args: argparse.Namespace) -> int:
    """The figure; with no other agent's evaluation of the agent's containers it is the
    neutral 0.5 of no evidence: said on stderr, exit 1 (as `recall` with nothing)."""
    async def work(client) -> int:
        figure = await client.trust(args.did)
        _print_json(figure, pretty=args.pretty)
        if figure["evaluators"]:
            return EXIT_OK
        print(f"hmpnode: nothing is known of {args.did}: no other agent evaluated its containers "
              f"(trust {figure['trust']:g} is the neutral figure)", file=sys.stderr)
        return EXIT_REJECTED

    return _call(args, work)


def cmd_interests(args: argparse.Namespace) -> int:
    """Show (no action), set (replace), add (to), clear (declare nothing: everything) or
    reset (back to [interests]) what the agent wants from the mesh."""
    given = {"mode": args.mode, "classes": args.class_ or [], "tags": args.tag or [], "senders": args.sender or [],
             "topics": args.topic or []}

    async def work(client) -> int:
        if args.action is None:
            out = await client.interests()
        elif args.action == "reset":
            out = await client.reset_interests()
        elif args.action == "clear":
            out = await client.set_interests()
        else:
            declared = given
            if args.action == "add":
                current = (await client.interests())["interests"]
                declared = {k: current[k] + [v for v in given[k] if v not in current[k]] for k in current if k != "mode"}
                declared["mode"] = args.mode or current["mode"]
            out = await client.set_interests(**declared)
        _print_json(out, pretty=args.pretty)
        return EXIT_OK

    if args.action in (None, "clear", "reset") and any(given.values()):
        raise CliError(f"interests {args.action or ''}: --mode, --class, --tag, --sender, --topic go with set or add")
    return _call(args, work)


def cmd_watch(args: argparse.Namespace) -> int:
    filters = {"class_": args.class_, "tag": args.tag, "sender": args.sender, "to_me": True if args.to_me else None}

    async def work(client) -> int:
        task = asyncio.current_task()
        stopped = False

        def stop() -> None:
            nonlocal stopped
            stopped = True
            task.cancel()

        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop)
        try:
            async for event in client.events(cursor=args.cursor, **filters):
                _emit(event)
        except asyncio.CancelledError:
            if not stopped:
                raise
        return EXIT_OK

    try:
        return _call(args, work)
    except KeyboardInterrupt:  # Ctrl-C: interrupted, as every command (SIGTERM ends it with 0)
        return EXIT_INTERRUPTED


# -- running the node: stop, log level ----------------------------------------


def _data_dir(args: argparse.Namespace) -> Path:
    from hmpnode.client import _default_data_dir

    return Path(args.data_dir).expanduser() if args.data_dir else _default_data_dir()


def _lock_holder(data_dir: Path) -> int | None:
    from hmpnode.daemon import DaemonError, lock_holder

    try:
        return lock_holder(data_dir)
    except DaemonError as exc:
        raise CliError(str(exc), exc.code) from None


def cmd_stop(args: argparse.Namespace) -> int:
    """Ask the node on --data-dir to stop (POST /v1/shutdown; SIGTERM to the lock's holder
    when its API does not answer), then wait until its lock is free: exit 0; 1 when no node
    runs there; 3 when it still runs at --timeout."""
    from hmpnode.client import Client, ClientError, UnsafeDataDir

    if not 0 < args.timeout <= 86400:
        raise CliError("--timeout must be within 0..86400 seconds")
    data_dir = _data_dir(args)
    pid = _lock_holder(data_dir)
    if pid is None:
        raise CliError(f"no node is running on {data_dir}", EXIT_REJECTED)

    async def main() -> int:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + args.timeout
        how = "api"
        try:
            async with Client.from_data_dir(data_dir, timeout=max(1.0, min(10.0, args.timeout))) as client:
                await client.shutdown(f"hmpnode stop, pid {os.getpid()}")
        except UnsafeDataDir as exc:
            raise _client_failure(exc) from None
        except ClientError as exc:  # no node.json (starting), an API that does not answer or refuses
            holder = _lock_holder(data_dir)
            if holder == 0:
                raise CliError(f"the node on {data_dir} did not answer ({exc}) and the pid in its lock file is "
                               "not the lock's holder: not signalled", EXIT_REJECTED) from None
            if holder is not None:
                how = "signal"
                try:
                    os.kill(holder, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        while (holder := _lock_holder(data_dir)) is not None:
            if loop.time() >= deadline:
                raise CliError(f"the node on {data_dir} (pid {holder or pid}) still runs after {args.timeout:g} s",
                               EXIT_STILL_RUNNING)
            await asyncio.sleep(0.1)
        _print_json({"stopped": True, "data_dir": str(data_dir), "pid": pid or None, "how": how})
        return EXIT_OK

    return asyncio.run(main())


def cmd_log_level(args: argparse.Namespace) -> int:
    """Show the running node's log level, or set it until SIGHUP or a restart."""
    async def work(client) -> int:
        _print_json(await client.set_log_level(args.level) if args.level else await client.log_level())
        return EXIT_OK

    return _call(args, work)


# -- backup and restore (hmpnode.backup) -------------------------------------


def cmd_backup(args: argparse.Namespace) -> int:
    from hmpnode.backup import BackupError, backup

    try:
        _print_json(backup(_data_dir(args), Path(args.dest).expanduser()))
    except BackupError as exc:
        raise CliError(str(exc), EXIT_USAGE if exc.usage else EXIT_REJECTED) from None
    return EXIT_OK


def cmd_restore(args: argparse.Namespace) -> int:
    """Put a backup in place as the store of --data-dir, with a start's checks, while
    holding the data dir's lock (refused while a node runs there: exit 1)."""
    from hmpnode import daemon
    from hmpnode.backup import BackupError, restore

    source = Path(args.backup).expanduser()
    if not source.is_dir():
        raise CliError(f"{source} is not a directory (a backup made by hmpnode backup)")
    try:
        settings = daemon.settings_for(daemon.RunOptions(
            data_dir=Path(args.data_dir).expanduser().absolute() if args.data_dir else None,
            config=Path(args.config).expanduser().absolute() if args.config else None), os.environ)
        daemon.prepare_data_dir(settings.data_dir)
        lock = daemon.DataDirLock(settings.data_dir)
        lock.acquire()
    except daemon.DaemonError as exc:
        raise CliError(f"restore: {exc}", exc.code) from None
    try:
        report = restore(source, settings.data_dir, settings.identity.keystore, allow_older=args.allow_older,
                         now=datetime.now(timezone.utc))
    except BackupError as exc:
        raise CliError(str(exc), EXIT_USAGE if exc.usage else EXIT_REJECTED) from None
    finally:
        lock.release()
    _print_json(report)
    return EXIT_OK


def cmd_export(args: argparse.Namespace) -> int:
    from hmpnode.backup import export_lines

    async def work(client) -> int:
        try:
            out = sys.stdout.buffer if args.out == "-" else open(args.out, "xb")
        except OSError as exc:
            raise CliError(f"--out {args.out}: {exc.strerror or exc}") from None
        count = 0
        try:
            async for line in export_lines(client):
                out.write(line)
                count += 1
            out.flush()
            if out is not sys.stdout.buffer:
                os.fsync(out.fileno())
        except OSError as exc:  # a full disk, most likely
            raise CliError(f"cannot write {args.out}: {exc.strerror or exc}", EXIT_REJECTED) from None
        finally:
            if out is not sys.stdout.buffer:
                out.close()
        print(f"hmpnode: exported {count} containers", file=sys.stderr)
        return EXIT_OK

    if args.out != "-" and os.path.lexists(args.out):
        raise CliError(f"--out {args.out} exists; give a new file")
    return _call(args, work)


def cmd_import(args: argparse.Namespace) -> int:
    from hmpnode.backup import ImportReport, import_lines, read_lines

    report = ImportReport()

    async def work(client) -> int:
        try:
            fh = sys.stdin.buffer if args.file == "-" else open(args.file, "rb")
        except OSError as exc:
            raise CliError(f"cannot read {args.file}: {exc.strerror or exc}") from None
        try:
            await import_lines(client, read_lines(fh, MAX_INPUT_BYTES), report)
        finally:
            if fh is not sys.stdin.buffer:
                fh.close()
        for number, did, reason, detail in report.problems:
            print(f"hmpnode: line {number}: {reason}: {detail}" + (f" ({did})" if did else ""), file=sys.stderr)
        _print_json(report.to_json())
        return EXIT_REJECTED if report.counts["rejected"] else EXIT_OK

    return _call(args, work)


# -- parser -----------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as everywhere else
        command = self.prog.partition(" ")[2]  # main() prints the "hmpnode: " itself
        raise CliError(f"{command}: {message}" if command else message)


def _describe(parser: argparse.ArgumentParser) -> None:
    """Every subcommand's --help starts with its one-line help and ends with the exit codes."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = parser.epilog or EXIT_CODES
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help for choice in action._choices_actions}
            for name, child in action.choices.items():
                child.description = child.description or helps.get(name)
                if child.description and "\n" not in child.description:  # the raw formatter keeps lines as they are
                    child.description = textwrap.fill(child.description, 88)
                _describe(child)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hmpnode", description="HyperCortex Mesh Protocol node and tools.")
    parser.add_argument("--version", action="version", version=f"hmpnode {__version__}")
    parser.add_argument("--data-dir", dest="global_data_dir", metavar="DATA_DIR",
                        help="data dir of the node, for the commands that talk to one (same as their --data-dir)")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("keygen", help="create an identity keystore")
    p.add_argument("--out", default="hmpnode-key.json", help="keystore file to write (default %(default)s)")
    p.add_argument("--passphrase-file", help="seal the key with the passphrase in this file (Argon2id + secretbox)")
    p.add_argument("--force", action="store_true", help="replace an existing keystore")
    p.set_defaults(func=cmd_keygen)

    c = sub.add_parser("container", help="build, verify, decrypt and inspect containers offline")
    csub = c.add_subparsers(dest="container_command", required=True, parser_class=_Parser)

    b = csub.add_parser("build", help="build and sign a container; prints its full form")
    b.add_argument("--key", required=True, help="keystore file of the sender")
    b.add_argument("--passphrase-file", help="file with the passphrase of a sealed --key")
    b.add_argument("--class", dest="class_", required=True, help=_class_help("container class"))
    b.add_argument("--allow-unknown-class", action="store_true", help="accept a --class the node has no schema for")
    b.add_argument("--subclass", help="subclass, e.g. goal.research_hypothesis")
    b.add_argument("--payload", help="JSON file with the payload object, or - for stdin (default {})")
    b.add_argument("--compress", choices=_compression.SUPPORTED, help="compress the payload")
    b.add_argument("--to", action="append", default=[], metavar="PUBLIC_KEY",
                   help="encrypt for this recipient (base58 key, or DID=KEY); repeat for a group")
    b.add_argument("--related", action="append", default=[], metavar="TYPE=DID",
                   help="a link to another container, e.g. in_reply_to=DID; repeatable")
    b.add_argument("--tag", action="append", default=[], help="a tag; repeatable")
    b.add_argument("--ttl", help="expiry: RFC 3339 UTC time or a duration (30m, 12h, 7d)")
    b.add_argument("--network", help='scope: "", "localhost" or "lan:<cidr>"')
    b.add_argument("--broadcast", action="store_true", help="for every node in scope, not only its recipients")
    b.add_argument("--confidence", type=float, help="the sender's confidence, 0..1")
    b.add_argument("--meta", help="JSON file with the meta object")
    b.add_argument("--now", help=argparse.SUPPRESS)
    b.add_argument("--pretty", action="store_true", help="indented output")
    b.set_defaults(func=cmd_build)

    v = csub.add_parser("verify", help="verify a container; prints a JSON verdict")
    v.add_argument("file", help="container file, or - for stdin")
    v.add_argument("--now", help="verify as of this time (RFC 3339 UTC)")
    v.add_argument("--pin", action="append", default=[], metavar="DID=KEY", help="a known DID-key binding")
    v.set_defaults(func=cmd_verify)

    d = csub.add_parser("decrypt", help="print the payload of a container addressed to this key")
    d.add_argument("--key", required=True, help="keystore file of a recipient")
    d.add_argument("--passphrase-file", help="file with the passphrase of a sealed --key")
    d.add_argument("file", help="container file, or - for stdin")
    d.add_argument("--pretty", action="store_true", help="indented output")
    d.set_defaults(func=cmd_decrypt)

    i = csub.add_parser("inspect", help="readable summary of a container")
    i.add_argument("file", help="container file, or - for stdin")
    i.set_defaults(func=cmd_inspect)

    r = sub.add_parser("run", help="run the node daemon (local agent API; stops on SIGINT/SIGTERM)",
                       description="Run the node daemon; stops on SIGINT/SIGTERM. By default it listens on: "
                                   "the agent API, TCP 127.0.0.1 (a free port); the peer port, TCP on every "
                                   "interface (a free port); the DHT, UDP on every interface (a free port); LAN "
                                   "discovery, UDP 47474 on every interface. To keep it to this machine: "
                                   "--peer-host 127.0.0.1 and HMPNODE_PEER_DISCOVERY_INTERFACES=127.0.0.1 (or "
                                   "HMPNODE_PEER_LAN_DISCOVERY=false); where it listens is in <data-dir>/node.json.")
    r.add_argument("--data-dir", help="state directory (default: $HMPNODE_DATA_DIR, else the user data dir)")
    r.add_argument("--config", help="TOML settings file (default: <data-dir>/hmpnode.toml when it exists)")
    r.add_argument("--api-host", help="address of the agent API (default 127.0.0.1)")
    r.add_argument("--api-port", help="port of the agent API; 0 picks a free one (default)")
    r.add_argument("--log-format", help="text or json (one JSON object per line)")
    r.add_argument("--log-level", help="debug, info, warning or error")
    r.add_argument("--roles", metavar="R,...", help="extra roles: relay, mailman, circuit")
    r.add_argument("--peer-host", help="address of the peer port and the DHT (default 0.0.0.0: every interface; "
                                       "127.0.0.1 keeps them to this machine)")
    r.add_argument("--peer-port", help="peer port (HTTP/WebSocket); 0 picks a free one (default)")
    r.add_argument("--dht-port", help="Kademlia DHT port (UDP); 0 picks a free one (default)")
    r.add_argument("--announce", metavar="ADDR,...", help="addresses to announce, tcp://IP[:PORT] or udp://IP[:PORT] "
                                                          "(peer.announce; e.g. a cloud VM's public address)")
    r.add_argument("--no-announce", metavar="CIDR,...", help="ranges never announced (peer.no_announce; e.g. a "
                                                              "container bridge's 172.16.0.0/12)")
    r.add_argument("--static", metavar="PEER,...", help="peers kept connected: tcp://host:port or "
                                                        "did:hmp:agent:...@tcp://host:port (peer.static)")
    r.add_argument("--accept-store-loss", action="store_true",
                   help="start even though the store is missing, empty or older than <data-dir>/store-state.json "
                        "says (otherwise a refusal, exit 2)")
    r.set_defaults(func=cmd_run)

    node = argparse.ArgumentParser(add_help=False)
    node.add_argument("--data-dir", help="data dir of the running node (default: $HMPNODE_DATA_DIR, else the user data dir)")

    cf = sub.add_parser("config", help="config show: the settings in force and where each came from; "
                                       "config check [FILE]: validate settings (exit 2 naming the key)")
    cf.add_argument("action", choices=("show", "check"), help="show: the settings in force and their sources "
                                                              "(secrets masked); check: validate and exit")
    cf.add_argument("file", nargs="?", help="check: the TOML file to check (default: <data-dir>/hmpnode.toml)")
    cf.add_argument("--data-dir", help="data dir (default: $HMPNODE_DATA_DIR, else the user data dir)")
    cf.add_argument("--config", help="TOML settings file (default: <data-dir>/hmpnode.toml when it exists)")
    cf.add_argument("--pretty", action="store_true", help="indented output")
    cf.set_defaults(func=cmd_config)

    st = sub.add_parser("status", parents=[node], help="where the running node listens and what it holds")
    st.add_argument("--pretty", action="store_true", help="indented output")
    st.set_defaults(func=cmd_status)

    rm = sub.add_parser("remember", parents=[node], help="store a memory (a note container of this agent)")
    rm.add_argument("text", help="the text, or - for stdin")
    rm.add_argument("--tag", action="append", default=[], help="a tag; repeatable")
    rm.add_argument("--ttl", help="expiry: RFC 3339 UTC time or a duration (30m, 12h, 7d)")
    rm.add_argument("--source", help="node-local: where it came from (a document, a tool, a URL); forget --source erases by it")
    rm.add_argument("--scope", help="node-local: the scope it joins (e.g. task:t1); recall --scope returns only members")
    rm.set_defaults(func=cmd_remember)

    fo = sub.add_parser("forget", parents=[node], help="erase a memory: one DID, everything from a --source, or a --scope")
    fo.add_argument("did", nargs="?", help="the container DID to erase")
    fo.add_argument("--source", help="erase every memory stored with this source label")
    fo.add_argument("--scope", help="erase every memory in this scope")
    fo.set_defaults(func=cmd_forget)

    sc = sub.add_parser("scope", parents=[node], help="scope accept SCOPE DID: take a held container (any sender's) into a scope")
    sc.add_argument("action", choices=("accept",), help="accept: take DID into SCOPE")
    sc.add_argument("scope", help="the scope, e.g. task:t1")
    sc.add_argument("did", help="a held container's DID")
    sc.set_defaults(func=cmd_scope)

    rc = sub.add_parser("recall", parents=[node], help="recall memories for a task within a token and a byte budget")
    rc.add_argument("query", help="what the memories are for, in words")
    rc.add_argument("--tokens", type=int, required=True, help="token budget (tokenizer hmpnode-approx-v1)")
    rc.add_argument("--bytes", type=int, required=True, help="UTF-8 byte budget of the whole answer")
    rc.add_argument("--why", action="store_true",
                    help="ask for the full receipt (DIDs, ranking signals) and print the whole envelope")
    rc.add_argument("--contested", action="store_true", help="also contested memories (marked)")
    rc.add_argument("--class", dest="class_", help="only memories of this class")
    rc.add_argument("--tag", help="only memories with this tag")
    rc.add_argument("--scope", help="only memories in this scope")
    rc.add_argument("--explain", action="store_true", help="only counts, reasons and budgets (no ids, no text: for logs)")
    rc.set_defaults(func=cmd_recall)

    jo = sub.add_parser("journal", parents=[node], help="the agent's journal: add, verify, load, anchor")
    jo.add_argument("action", choices=("add", "verify", "load", "anchor"),
                    help="add an entry, verify the chain, load the newest entries within --tokens, "
                         "or anchor a day")
    jo.add_argument("text", nargs="?", help="add: the entry text, or - for stdin")
    jo.add_argument("--title", help="add: the entry's title")
    jo.add_argument("--tag", action="append", default=[], help="add: a tag; repeatable")
    jo.add_argument("--tokens", type=int, default=2000, help="load: token budget (default 2000)")
    jo.add_argument("--routine", action="store_true", help="load: include routine entries")
    jo.add_argument("--date", help="anchor: the UTC day YYYY-MM-DD (default yesterday)")
    jo.set_defaults(func=cmd_journal)

    mc = sub.add_parser("mcp", parents=[node], help="MCP server on stdio: the running node's memory and mesh as tools "
                                                    "(refuses to start, exit 1, if no node answers on the data dir)")
    mc.set_defaults(func=cmd_mcp)

    wa = sub.add_parser("wait", parents=[node], help="wait until the node on the data dir answers; prints its node.json")
    wa.add_argument("--timeout", type=float, default=WAIT_TIMEOUT,
                    help="seconds to wait at most, then exit 1 (default %(default)g)")
    wa.set_defaults(func=cmd_wait)

    ident = sub.add_parser("id", parents=[node], help="the running node's agent DID (for shell variables)")
    ident.add_argument("--public-key", action="store_true",
                       help="print its base58 public key instead (what --to takes)")
    ident.set_defaults(func=cmd_id)

    sr = sub.add_parser("search", parents=[node], help="full-text search over the node's containers (BM25)")
    sr.add_argument("query", help="words to search for")
    sr.add_argument("--class", dest="class_", help="only containers of this class")
    sr.add_argument("--tag", help="only containers with this tag")
    sr.add_argument("--sender", metavar="DID", help="only containers of this sender")
    sr.add_argument("--state", help="comma-separated: active, superseded, expired, contested, revoked, retracted")
    sr.add_argument("--limit", type=int, help="most hits (1..1000)")
    sr.add_argument("--scope", help="only containers in this scope")
    sr.add_argument("--pretty", action="store_true", help="indented output")
    sr.set_defaults(func=cmd_search)

    pe = sub.add_parser("peers", parents=[node], help="peers the running node knows, and its mesh state; "
                        "list/add/remove: its static peers (kept connected; added ones survive a restart)")
    pe.add_argument("action", nargs="?", choices=("list", "add", "remove"),
                    help="list: the static peers; add: keep one connected; remove: stop (by spec or DID)")
    pe.add_argument("spec", nargs="?", help="tcp://host:port or did:...@tcp://host:port (remove: also a DID)")
    pe.add_argument("--pretty", action="store_true", help="indented output")
    pe.set_defaults(func=cmd_peers)

    pi = sub.add_parser("peer-index", parents=[node],
                        help="one page of a connected peer's container index (nothing is fetched)")
    pi.add_argument("did", help="the peer's DID")
    pi.add_argument("--class", dest="class_", help="only containers of this class")
    pi.add_argument("--tag", help="only containers with this tag")
    pi.add_argument("--sender", metavar="DID", help="only containers of this sender")
    pi.add_argument("--related", metavar="DID", help="only containers whose related block names this DID")
    pi.add_argument("--relation", help="with --related: by this relation (e.g. previous_version)")
    pi.add_argument("--cursor", help="the cursor a previous page gave")
    pi.add_argument("--limit", type=int, help="at most this many entries")
    pi.add_argument("--pretty", action="store_true", help="indented output")
    pi.set_defaults(func=cmd_peer_index)

    da = sub.add_parser("dashboard", parents=[node],
                        help="print the URL of the node's web dashboard, the token after '#' (never sent to a server)")
    da.add_argument("--open", action="store_true",
                    help="also open it in the default web browser (through a private file in the data dir, so "
                         "that the token is not on the browser's command line)")
    da.set_defaults(func=cmd_dashboard)

    se = sub.add_parser("send", parents=[node], help="have the node build, sign and store a container",
                        description="Build, sign and store a container on the node. Without --broadcast or --to "
                                    "it is addressed to no one and stays on this node; --network (default \"\": "
                                    "no limit) narrows where a broadcast or addressed one may go.")
    se.add_argument("--class", dest="class_", required=True, help=_class_help("container class"))
    se.add_argument("--allow-unknown-class", action="store_true", help="accept a --class the node has no schema for")
    se.add_argument("--subclass", help="subclass, e.g. goal.research_hypothesis")
    se.add_argument("--payload", help="JSON file with the payload object, or - for stdin (default {})")
    se.add_argument("--to", action="append", default=[], metavar="PUBLIC_KEY",
                    help="encrypt for this recipient (base58 key, or DID=KEY); repeat for a group")
    se.add_argument("--tag", action="append", default=[], help="a tag; repeatable")
    se.add_argument("--related", action="append", default=[], metavar="TYPE=DID",
                    help="a link to another container, e.g. in_reply_to=DID; repeatable")
    se.add_argument("--ttl", help="expiry: RFC 3339 UTC time or a duration (30m, 12h, 7d)")
    se.add_argument("--network", help='scope: "", "localhost" or "lan:<cidr>"')
    se.add_argument("--broadcast", action="store_true", help="for every node in scope, not only its recipients")
    se.add_argument("--compress", choices=_compression.SUPPORTED, help="compress the payload")
    se.add_argument("--confidence", type=float, help="the sender's confidence, 0..1")
    se.add_argument("--meta", help="JSON file with the meta object")
    se.add_argument("--full", action="store_true", help="include the container in the output")
    se.add_argument("--pretty", action="store_true", help="indented output")
    se.set_defaults(func=cmd_send)

    g = sub.add_parser("get", parents=[node], help="a stored container, with links and evaluations")
    g.add_argument("did", help="the container's DID")
    g.add_argument("--decrypt", action="store_true", help="add the payload, opened with the node's key")
    g.add_argument("--pretty", action="store_true", help="indented output")
    g.set_defaults(func=cmd_get)

    vs = sub.add_parser("versions", parents=[node], help="versions and forks of a held container (spec 3.12)")
    vs.add_argument("did", help="the container's DID")
    vs.add_argument("--mesh", action="store_true", help="also ask the connected peers' indexes (spec 5.7)")
    vs.add_argument("--pretty", action="store_true", help="indented output")
    vs.set_defaults(func=cmd_versions)

    ls = sub.add_parser("list", parents=[node], help="stored containers, one JSON line each")
    ls.add_argument("--class", dest="class_", help="only containers of this class")
    ls.add_argument("--tag", help="only containers with this tag")
    ls.add_argument("--sender", metavar="DID", help="only containers of this sender")
    ls.add_argument("--recipient", metavar="DID", help="only containers addressed to this agent")
    ls.add_argument("--related", metavar="DID", help="containers linking to this DID")
    ls.add_argument("--order", choices=("asc", "desc"), help="oldest (asc, default) or newest first")
    ls.add_argument("--limit", type=int, help="items per page")
    ls.add_argument("--cursor", help="continue after this cursor")
    ls.add_argument("--all", action="store_true", help="follow cursors to the end")
    ls.set_defaults(func=cmd_list)

    ev = sub.add_parser("evaluate", parents=[node], help="sign an evaluation of a stored container")
    ev.add_argument("did", help="DID of the container evaluated")
    ev.add_argument("--type", required=True, help="evaluation type: one of the spec's support, oppose, extend, "
                                                  "replace, comment (others need --allow-custom-type)")
    ev.add_argument("--allow-custom-type", action="store_true",
                    help="accept a --type that is not one of the spec's (agents may define their own)")
    ev.add_argument("--value", required=True, type=float, help="the evaluation, -1..1")
    ev.add_argument("--target", metavar="DID", help="what is evaluated (default: the container itself)")
    ev.add_argument("--pretty", action="store_true", help="indented output")
    ev.set_defaults(func=cmd_evaluate)

    pr = sub.add_parser("propose", parents=[node], help="publish a proposal other agents vote on until its deadline")
    pr.add_argument("text", help="what is proposed")
    pr.add_argument("--ttl", help="voting deadline: a duration (30m, 12h, 7d) or RFC 3339 UTC "
                                  "(default: consensus.default_ttl_seconds)")
    pr.add_argument("--quorum", type=int, help="counted voters needed (default: consensus.quorum)")
    pr.add_argument("--threshold", type=float, help="score needed, (0, 1] (default: consensus.threshold_percent)")
    pr.add_argument("--voter", action="append", metavar="DID", help="only these agents may vote (repeatable)")
    pr.add_argument("--weighting", choices=("equal", "trust"), help="vote weights (default: consensus.weighting)")
    pr.add_argument("--tag", action="append", help="a tag of the proposal (repeatable)")
    pr.add_argument("--pretty", action="store_true", help="indented output")
    pr.set_defaults(func=cmd_propose)

    vo = sub.add_parser("vote", parents=[node], help="vote on a held proposal (a later vote replaces this one)")
    vo.add_argument("did", help="DID of the proposal")
    vo.add_argument("value", help="yes, no, abstain, or a number in [-1, 1]")
    vo.add_argument("--type", help="a label: approval, objection, abstain, ...")
    vo.add_argument("--reason", help="why (kept in the vote's arguments)")
    vo.add_argument("--pretty", action="store_true", help="indented output")
    vo.set_defaults(func=cmd_vote)

    co = sub.add_parser("consensus", parents=[node], help="a proposal's state, votes and recounted results")
    co.add_argument("did", help="DID of the proposal")
    co.add_argument("--pretty", action="store_true", help="indented output")
    co.set_defaults(func=cmd_consensus)

    tr = sub.add_parser("trust", parents=[node], help="the node's trust figure of an agent (from evaluations)")
    tr.add_argument("did", help="DID of the agent")
    tr.add_argument("--pretty", action="store_true", help="indented output")
    tr.set_defaults(func=cmd_trust)

    it = sub.add_parser("interests", parents=[node], help="what the agent wants from the mesh: peers send it only "
                        "matching broadcasts (no action: show)")
    it.add_argument("action", nargs="?", choices=("set", "add", "clear", "reset"),
                    help="set: replace; add: to the current ones; clear: none (everything); reset: back to [interests]")
    it.add_argument("--mode", choices=("selective", "everything"), help="everything: all broadcasts (relays)")
    it.add_argument("--class", dest="class_", action="append", metavar="CLASS", help="a class (repeatable)")
    it.add_argument("--tag", action="append", help="a tag (repeatable)")
    it.add_argument("--sender", action="append", metavar="DID", help="a sender's DID (repeatable)")
    it.add_argument("--topic", action="append", help="a topic: a tag also published in the DHT (repeatable)")
    it.add_argument("--pretty", action="store_true", help="indented output")
    it.set_defaults(func=cmd_interests)

    w = sub.add_parser("watch", parents=[node], help="print new containers as JSON lines until Ctrl-C")
    w.add_argument("--class", dest="class_", help="only containers of this class")
    w.add_argument("--tag", help="only containers with this tag")
    w.add_argument("--sender", metavar="DID", help="only containers of this sender")
    w.add_argument("--to-me", action="store_true", help="only containers addressed to this node's agent")
    w.add_argument("--cursor", help="start after this cursor, e.g. the last one printed (default: only what arrives from now on)")
    w.set_defaults(func=cmd_watch)

    so = sub.add_parser("stop", parents=[node], help="stop the node running on the data dir cleanly and wait until "
                        "it is gone (exit 1: no node runs there; 3: still running at --timeout)")
    so.add_argument("--timeout", type=float, default=STOP_TIMEOUT,
                    help="seconds to wait for the node to be gone (default %(default)g)")
    so.set_defaults(func=cmd_stop)

    from hmpnode.logs import LEVELS

    ll = sub.add_parser("log-level", parents=[node], help="show the running node's log level, or set it (until "
                        "SIGHUP, which reads node.log_level again, or a restart; not saved)")
    ll.add_argument("level", nargs="?", choices=LEVELS, help="the level to set: " + ", ".join(LEVELS))
    ll.set_defaults(func=cmd_log_level)

    rs = sub.add_parser("restore", help="put a backup in place as the data dir's store, with a start's checks "
                        "(same agent, sound store, not older than the data dir's record); no node may run there")
    rs.add_argument("backup", help="the directory hmpnode backup made")
    rs.add_argument("--data-dir", help="data dir to restore into (default: $HMPNODE_DATA_DIR, else the user data dir)")
    rs.add_argument("--config", help="TOML settings file (default: <data-dir>/hmpnode.toml when it exists)")
    rs.add_argument("--allow-older", action="store_true",
                    help="restore a backup older than the data dir's record (store-state.json, the store in place): "
                         "what the node stored since is dropped (the old store is kept aside)")
    rs.set_defaults(func=cmd_restore)

    for name, func, what, arg, options in (
        ("backup", cmd_backup, "copy the store (consistent while the node runs), identity and settings into a new "
         "directory a node can start from", "dest", {"help": "the new directory to create"}),
        ("export", cmd_export, "every container the running node holds, as JSON lines (for hmpnode import)",
         "--out", {"default": "-", "help": "a new file to write (default - : stdout)"}),
        ("import", cmd_import, "send containers (JSON lines of hmpnode export, or containers) to the running node; "
         "each is verified as ingest does; exit 1 if any is not taken",
         "file", {"help": "the JSON lines file, or - for stdin"}),
    ):
        op = sub.add_parser(name, parents=[node], help=what, description=what)
        op.add_argument(arg, **options)
        op.set_defaults(func=func)
    _describe(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if getattr(args, "data_dir", None) is None and args.global_data_dir is not None:
            args.data_dir = args.global_data_dir
        return args.func(args)
    except CliError as exc:
        print(f"hmpnode: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_REJECTED
    except SystemExit as exc:  # --help / --version
        return int(exc.code or 0)


__all__ = ["main", "build_parser"]
