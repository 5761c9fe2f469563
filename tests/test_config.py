"""Settings: defaults, the example file, layer precedence, env parsing, and
every invalid setting surfacing as ConfigError naming the setting and its source."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import tomllib
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from hmpnode.config import (
    ApiSettings,
    ConfigError,
    IdentitySettings,
    LimitsSettings,
    NodeSettings,
    PeerSettings,
    RecallSettings,
    RelaySettings,
    ConsensusSettings,
    InterestsSettings,
    DeltaSettings,
    Settings,
    StoreSettings,
    default_data_dir,
    env_var_name,
    load_settings,
)
from hmpnode.container.verify import Limits

from .conftest import bare_node

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "config" / "hmpnode.example.toml"
SECTIONS = ("node", "identity", "api", "limits", "store", "peer", "relay", "recall", "consensus", "interests",
            "delta")


def load(data_dir: Path, *, config_file: Path | None = None, env: dict[str, str] | None = None,
         overrides: dict[str, Any] | None = None, **kw: Any) -> Settings:
    return load_settings(data_dir=data_dir, config_file=config_file, env=env or {}, overrides=overrides or {}, **kw)


def write_conf(data_dir: Path, text: str) -> Path:
    data_dir.mkdir(parents=True, exist_ok=True)
    path = data_dir / "hmpnode.toml"
    path.write_text(text, encoding="utf-8")
    return path


def error(match: str, **kw: Any) -> str:
    with pytest.raises(ConfigError) as info:
        load(**kw)
    message = str(info.value)
    assert re.search(match, message), message
    return message


# --------------------------------------------------------------------------- defaults


def test_defaults(tmp_path: Path) -> None:
    s = load(tmp_path)
    assert s.data_dir == tmp_path
    assert s.node == NodeSettings(log_format="text", log_level="info", roles=(), name="")
    assert s.identity == IdentitySettings(keystore=tmp_path / "identity.json", passphrase_file=None)
    assert s.api == ApiSettings(
        host="127.0.0.1", port="auto", max_body_bytes=8 * 1024 * 1024, max_batch=1000, max_list_limit=1000,
        default_list_limit=100, max_event_subscribers=64, event_queue_size=10_000,
    )
    assert s.limits == LimitsSettings(
        max_container_bytes=1024 * 1024, max_depth=64, max_clock_skew_seconds=300,
        max_decompressed_bytes=16 * 1024 * 1024,
    )
    assert s.store == StoreSettings(synchronous="full", batch_max=512, batch_wait_ms=2, reader_threads=2)
    assert s.peer == PeerSettings(
        host="0.0.0.0", port="auto", dht=True, dht_port=0, bootstrap=(), lan_discovery=True, discovery_port=47474,
        discovery_group="239.255.74.77", discovery_mode="both", discovery_interval_ms=5000, discovery_interfaces=(),
        min_difficulty=3, target_peers=8, max_peers=64, fanout=4, max_frame_bytes=4 * 1024 * 1024,
        max_items_per_frame=512, frames_per_second=200, containers_per_second=2000, strike_threshold=50,
        ban_seconds=600, mailman=(),
    )
    assert s.relay == RelaySettings(max_per_recipient=100_000, max_bytes_per_recipient=256 * 1024 * 1024,
                                    max_total_bytes=2 * 1024 * 1024 * 1024)


def test_mesh_settings_follow_the_peer_and_relay_sections(tmp_path: Path) -> None:
    from hmpnode.daemon import mesh_settings

    s = load(tmp_path, env={"HMPNODE_PEER_BOOTSTRAP": "127.0.0.1:4000,[::1]:4001", "HMPNODE_NODE_ROLES": "relay",
                            "HMPNODE_PEER_DISCOVERY_INTERVAL_MS": "250", "HMPNODE_RELAY_MAX_PER_RECIPIENT": "7"})
    m = mesh_settings(s)
    assert m.bootstrap == (("127.0.0.1", 4000), ("::1", 4001))
    assert m.roles == ("relay",) and m.lan.interval == 0.25 and m.relay.max_per_recipient == 7
    assert m.host == "0.0.0.0" and m.mesh.fanout == 4


#: MeshSettings' own fields: facts about this node, not limits (a limit belongs in its area's object)
MESH_FACTS = {"host", "port", "roles", "name", "interests", "mailman", "min_difficulty", "pinned", "allow",
              "idle_connection_seconds", "dht", "dht_port", "bootstrap", "declared"}


def _mesh_parts() -> dict[str, type]:
    """MeshSettings' limits objects: field name -> type."""
    from hmpnode.net.settings import MeshSettings

    default = MeshSettings()
    return {f.name: type(getattr(default, f.name)) for f in dataclasses.fields(MeshSettings)
            if f.name not in MESH_FACTS}


def test_every_limit_is_declared_once() -> None:
    """MeshSettings holds facts and limits objects only; no fact repeats a limit of those objects
    (as relay_max_* once repeated relayquota.RelayLimits); each object is frozen."""
    from hmpnode.net.lan import LanSettings

    parts = _mesh_parts()
    assert set(parts) == {"mesh", "session", "relay", "delta", "slots", "dialing", "dht_limits", "lan", "dialback", "circuit", "addresses", "punch"}
    for name, cls in parts.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name
        declared = {f.name for f in dataclasses.fields(cls)}
        if cls is LanSettings:  # the LAN's own port; the node's min_difficulty, which it demands too
            declared -= {"port", "min_difficulty"}
        assert not MESH_FACTS & declared, (name, MESH_FACTS & declared)


def test_config_defaults_are_the_limits_defaults(tmp_path: Path) -> None:
    """Each section builds its limits objects; with nothing configured they are the objects'
    own defaults (declared in their modules), so the config's defaults cannot drift from them."""
    from hmpnode.daemon import mesh_settings

    m = mesh_settings(load(tmp_path))
    for name, cls in _mesh_parts().items():
        assert getattr(m, name) == cls(), name


def test_toml_values_reach_the_limits_the_mesh_uses(tmp_path: Path) -> None:
    """A value in hmpnode.toml arrives, converted once, in the object the core and the sessions
    read: the same object, not a copy of it."""
    from hmpnode.daemon import mesh_settings
    from hmpnode.identity.keys import Identity
    from hmpnode.net.core import MeshCore
    from hmpnode.net.mesh import Mesh

    conf = write_conf(tmp_path, "[peer]\nrequest_timeout_ms = 2500\nfanout = 6\nannounce_delay_ms = 50\n"
                                "verify_ms_per_second = 250\ntarget_peers = 3\nmin_difficulty = 2\n"
                                "[relay]\nmax_per_recipient = 7\nreoffer_ms = 4000\n"
                                "[interests]\nqueries_per_minute = 9\ntopic_dials = 1\n[delta]\nflush_ms = 300\n")
    m = mesh_settings(load(tmp_path, config_file=conf))
    assert (m.session.request_timeout_seconds, m.session.relay_reoffer_seconds) == (2.5, 4.0)
    assert (m.session.verify_seconds_per_second, m.session.verify_burst_seconds) == (0.25, 1.0)
    assert (m.session.peer_queries_per_minute, m.dialing.topic_dials) == (9, 1)
    assert (m.mesh.fanout, m.mesh.announce_delay_seconds, m.delta.flush_seconds) == (6, 0.05, 0.3)
    assert (m.dialing.target_peers, m.slots.outbound_slots) == (3, 3)
    assert m.min_difficulty == m.lan.min_difficulty == 2
    assert m.relay.max_per_recipient == 7
    core = MeshCore(Identity(bytes([5]) * 32), m, random.Random(1))
    assert core.relay_limits is m.relay
    mesh = Mesh(bare_node(tmp_path), m)
    assert mesh.settings.session is m.session and mesh.admission.limits is m.slots


def test_limit_defaults_match_the_verifier() -> None:
    assert LimitsSettings().verify_limits() == Limits()


def test_settings_are_frozen(tmp_path: Path) -> None:
    s = load(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.api.port = 1  # type: ignore[misc]


def test_default_data_dir() -> None:
    d = default_data_dir()
    assert isinstance(d, Path) and d.name == "hmpnode"


def test_data_dir_from_env_when_not_given(tmp_path: Path) -> None:
    s = load_settings(data_dir=None, config_file=None, env={"HMPNODE_DATA_DIR": str(tmp_path)}, overrides={})
    assert s.data_dir == tmp_path
    assert s.identity.keystore == tmp_path / "identity.json"
    # the argument wins over the environment
    other = tmp_path / "other"
    s = load_settings(data_dir=other, config_file=None, env={"HMPNODE_DATA_DIR": str(tmp_path)}, overrides={})
    assert s.data_dir == other


def test_data_dir_falls_back_to_platform_default() -> None:
    s = load_settings(data_dir=None, config_file=None, env={}, overrides={})
    assert s.data_dir == default_data_dir().absolute()


def test_empty_data_dir_env_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r'data_dir = "" \(from HMPNODE_DATA_DIR\)'):
        load_settings(data_dir=None, config_file=None, env={"HMPNODE_DATA_DIR": ""}, overrides={})


def test_to_dict(tmp_path: Path) -> None:
    d = load(tmp_path, overrides={"node.roles": ["relay"]}).to_dict()
    json.dumps(d)  # plain values only
    assert list(d) == ["data_dir", *SECTIONS]
    assert d["data_dir"] == str(tmp_path)
    assert d["identity"] == {"keystore": str(tmp_path / "identity.json"), "passphrase_file": ""}
    assert d["node"]["roles"] == ["relay"]
    assert d["api"]["max_body_bytes"] == 8 * 1024 * 1024
    assert d["peer"]["lan_discovery"] is True


def test_to_dict_round_trips_through_a_file(tmp_path: Path) -> None:
    s = load(tmp_path, overrides={"node.roles": "relay,mailman", "identity.passphrase_file": "/p", "api.port": 9})
    d = s.to_dict()
    del d["data_dir"]
    lines = []
    for section, table in d.items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in table.items()]
    conf = tmp_path / "rt.toml"
    conf.write_text("\n".join(lines))
    assert load(tmp_path, config_file=conf) == s


# --------------------------------------------------------------------------- example file


def test_example_file_loads_to_the_defaults(tmp_path: Path) -> None:
    assert load(tmp_path, config_file=EXAMPLE) == load(tmp_path)


def test_example_file_in_the_data_dir_loads_to_the_defaults(tmp_path: Path) -> None:
    write_conf(tmp_path, EXAMPLE.read_text(encoding="utf-8"))
    assert load(tmp_path) == Settings(data_dir=tmp_path, identity=IdentitySettings(keystore=tmp_path / "identity.json"))


def test_example_file_documents_every_setting() -> None:
    doc = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))
    expected = {
        name: [f.name for f in dataclasses.fields(cls)]
        for name, cls in zip(SECTIONS, (NodeSettings, IdentitySettings, ApiSettings, LimitsSettings,
                                        StoreSettings, PeerSettings, RelaySettings, RecallSettings, ConsensusSettings,
                                        InterestsSettings, DeltaSettings))
    }
    assert {section: list(table) for section, table in doc.items()} == expected
    # each setting has a comment on the line above it
    lines = EXAMPLE.read_text(encoding="utf-8").splitlines()
    for i, line in enumerate(lines):
        if re.match(r"^[a-z_]+ = ", line):
            assert lines[i - 1].startswith("# "), line


# --------------------------------------------------------------------------- precedence


def test_file_overrides_defaults(tmp_path: Path) -> None:
    write_conf(tmp_path, '[api]\nport = 7000\n[node]\nlog_format = "json"\nroles = ["relay"]\n')
    s = load(tmp_path)
    assert (s.api.port, s.node.log_format, s.node.roles) == (7000, "json", ("relay",))
    assert s.api.host == "127.0.0.1"  # untouched keys keep their defaults


def test_precedence_file_env_overrides(tmp_path: Path) -> None:
    write_conf(tmp_path, "[api]\nport = 7000\nmax_batch = 10\nmax_list_limit = 200\n")
    env = {"HMPNODE_API_PORT": "7001", "HMPNODE_API_MAX_BATCH": "11"}
    s = load(tmp_path, env=env, overrides={"api.port": 7002})
    assert (s.api.port, s.api.max_batch, s.api.max_list_limit) == (7002, 11, 200)
    s = load(tmp_path, env=env)
    assert (s.api.port, s.api.max_batch, s.api.max_list_limit) == (7001, 11, 200)


def test_explicit_config_file_replaces_the_data_dir_file(tmp_path: Path) -> None:
    write_conf(tmp_path, "[api]\nport = 7000\nmax_batch = 10\n")
    other = tmp_path / "elsewhere.toml"
    other.write_text("[api]\nport = 8000\n")
    s = load(tmp_path, config_file=other)
    assert (s.api.port, s.api.max_batch) == (8000, 1000)


def test_none_override_means_flag_not_given(tmp_path: Path) -> None:
    s = load(tmp_path, env={"HMPNODE_API_PORT": "7001"}, overrides={"api.port": None, "node.log_format": None})
    assert (s.api.port, s.node.log_format) == (7001, "text")


def test_overrides_accept_strings_like_the_environment(tmp_path: Path) -> None:
    s = load(tmp_path, overrides={"api.port": "8080", "peer.lan_discovery": "no", "peer.bootstrap": "a:1, b:2"})
    assert (s.api.port, s.peer.lan_discovery, s.peer.bootstrap) == (8080, False, ("a:1", "b:2"))


def test_unrelated_environment_is_ignored(tmp_path: Path) -> None:
    s = load(tmp_path, env={"PATH": "/bin", "HMPNODE_DATA_DIR": "/nowhere", "HMPNODE_TEST_WORKERS": "2",
                            "HMPNODE_REQUIRE_NETNS": "1"})
    assert s == load(tmp_path)


@pytest.mark.parametrize("name", ["HMPNODE_BOGUS", "HMPNODE_SOMETHING_ELSE", "HMPNODE_PEERS_PORT"])
def test_an_hmpnode_variable_that_names_no_setting_is_refused(tmp_path: Path, name: str) -> None:
    """Before, a variable whose section is unknown was silently ignored (a typo in a key of a
    known section was already refused)."""
    with pytest.raises(ConfigError, match=f"unknown setting {name}: no section"):
        load(tmp_path, env={name: "1"})


def test_sources_say_where_each_setting_came_from(tmp_path: Path) -> None:
    from hmpnode.config import load_settings, masked

    write_conf(tmp_path, "[api]\nmax_batch = 10\n")
    sources: dict[str, str] = {}
    s = load_settings(data_dir=tmp_path, config_file=None, env={"HMPNODE_PEER_FANOUT": "3"},
                      overrides={"api.port": "8080"}, override_sources={"api.port": "--api-port"}, sources_out=sources)
    shown = s.shown(sources)
    assert shown["api"]["max_batch"] == {"value": 10, "source": str(tmp_path / "hmpnode.toml")}
    assert shown["peer"]["fanout"] == {"value": 3, "source": "HMPNODE_PEER_FANOUT"}
    assert shown["api"]["port"] == {"value": 8080, "source": "--api-port"}
    assert shown["node"]["log_level"] == {"value": "info", "source": "default"}
    assert set(shown) == set(s.to_dict()) - {"data_dir"}
    assert masked("api.token", "abc") == "***" and masked("x.secret", "") == ""
    assert masked("identity.passphrase_file", "/run/pass") == "/run/pass"  # a path, not the secret


def test_env_var_name() -> None:
    assert env_var_name("api.port") == "HMPNODE_API_PORT"
    assert env_var_name("node.log_format") == "HMPNODE_NODE_LOG_FORMAT"


# --------------------------------------------------------------------------- env parsing


def test_env_int_bool_list_path_str(tmp_path: Path) -> None:
    env = {
        "HMPNODE_API_PORT": "8080",
        "HMPNODE_API_MAX_BODY_BYTES": " 1024 ",
        "HMPNODE_PEER_LAN_DISCOVERY": "false",
        "HMPNODE_PEER_BOOTSTRAP": "seed.example:7000, 10.0.0.1:7001,[::1]:7002,,",
        "HMPNODE_NODE_ROLES": "relay,mailman,relay",
        "HMPNODE_IDENTITY_KEYSTORE": "/abs/key.json",
        "HMPNODE_IDENTITY_PASSPHRASE_FILE": "secrets/pass",
        "HMPNODE_NODE_LOG_FORMAT": "JSON",
        "HMPNODE_NODE_NAME": "alice's node",
    }
    s = load(tmp_path, env=env)
    assert s.api.port == 8080 and s.api.max_body_bytes == 1024
    assert s.peer.lan_discovery is False
    assert s.peer.bootstrap == ("seed.example:7000", "10.0.0.1:7001", "[::1]:7002")
    assert s.node.roles == ("relay", "mailman")  # repeats dropped, order kept
    assert s.identity.keystore == Path("/abs/key.json")
    assert s.identity.passphrase_file == tmp_path / "secrets" / "pass"  # relative to the data dir
    assert s.node.log_format == "json"
    assert s.node.name == "alice's node"


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("false", False), ("1", True), ("0", False), ("yes", True), ("no", False),
    ("TRUE", True), ("No", False),
])
def test_env_bool_words(tmp_path: Path, text: str, value: bool) -> None:
    assert load(tmp_path, env={"HMPNODE_PEER_LAN_DISCOVERY": text}).peer.lan_discovery is value


def test_env_empty_list_and_optional_path(tmp_path: Path) -> None:
    write_conf(tmp_path, '[peer]\nbootstrap = ["a:1"]\n[identity]\npassphrase_file = "p"\n')
    s = load(tmp_path, env={"HMPNODE_PEER_BOOTSTRAP": "", "HMPNODE_IDENTITY_PASSPHRASE_FILE": ""})
    assert s.peer.bootstrap == () and s.identity.passphrase_file is None


def test_paths_expand_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    s = load(tmp_path, env={"HMPNODE_IDENTITY_KEYSTORE": "~/k.json"})
    assert s.identity.keystore == tmp_path / "home" / "k.json"


# --------------------------------------------------------------------------- errors


def test_bad_port_from_env(tmp_path: Path) -> None:
    msg = error(r"peer\.dht_port = 70000 \(from HMPNODE_PEER_DHT_PORT\): must be an integer 0\.\.65535",
                data_dir=tmp_path, env={"HMPNODE_PEER_DHT_PORT": "70000"})
    assert msg == "peer.dht_port = 70000 (from HMPNODE_PEER_DHT_PORT): must be an integer 0..65535"


@pytest.mark.parametrize("text", ["70000", "-1", "abc", "80.5", "", "autom"])
def test_bad_stable_port(tmp_path: Path, text: str) -> None:
    """api.port and peer.port: "auto" (kept from the first start) or a port."""
    msg = error(r"api\.port = .* \(from HMPNODE_API_PORT\)", data_dir=tmp_path, env={"HMPNODE_API_PORT": text})
    assert msg.endswith('must be "auto" (the port of the first start, kept) or a port 0..65535 (0: any)'), msg
    assert load(tmp_path, env={"HMPNODE_PEER_PORT": "AUTO", "HMPNODE_API_PORT": "0"}).peer.port == "auto"


@pytest.mark.parametrize("text", ["abc", "80.5", "", "0x50", "1e3"])
def test_non_integer_from_env(tmp_path: Path, text: str) -> None:
    error(rf'peer\.dht_port = {re.escape(json.dumps(text))} \(from HMPNODE_PEER_DHT_PORT\): must be an integer',
          data_dir=tmp_path, env={"HMPNODE_PEER_DHT_PORT": text})


def test_bad_port_from_file(tmp_path: Path) -> None:
    path = write_conf(tmp_path, "[peer]\ndht_port = -1\n")
    error(rf"peer\.dht_port = -1 \(from {re.escape(str(path))}\): must be an integer 0\.\.65535", data_dir=tmp_path)


@pytest.mark.parametrize("value", ['"8080"', "80.0", "true", "[1]"])
def test_wrong_toml_type(tmp_path: Path, value: str) -> None:
    write_conf(tmp_path, f"[peer]\ndht_port = {value}\n")
    error(r"peer\.dht_port = .* \(from .*hmpnode\.toml\): must be an integer", data_dir=tmp_path)


def test_bad_choice_from_override(tmp_path: Path) -> None:
    msg = error(r"node\.log_format", data_dir=tmp_path, overrides={"node.log_format": "xml"},
                override_sources={"node.log_format": "--log-format"})
    assert msg == 'node.log_format = "xml" (from --log-format): must be one of text, json'


def test_override_default_source_label(tmp_path: Path) -> None:
    error(r'store\.synchronous = "off" \(from override store\.synchronous\): must be one of full, normal',
          data_dir=tmp_path, overrides={"store.synchronous": "off"})


@pytest.mark.parametrize(("setting", "value", "rule"), [
    ("node.log_level", "verbose", "must be one of debug, info, warning, error"),
    ("store.synchronous", "off", "must be one of full, normal"),
    ("node.roles", "relay,bogus", "must list roles among relay, mailman"),
    ("peer.bootstrap", "nohost", 'must list "host:port" entries'),
    ("peer.bootstrap", "h:0", 'must list "host:port" entries'),
    ("peer.bootstrap", "::1:7000", 'must list "host:port" entries'),
    ("peer.lan_discovery", "maybe", "must be true or false"),
    ("api.host", "not a host", "must be an IP address or a host name"),
    ("peer.host", "", "must be an IP address or a host name"),
    ("node.name", "x" * 65, "must be at most 64 printable characters"),
    ("node.name", "tab\there", "must be at most 64 printable characters"),
    ("identity.keystore", "", "must be a non-empty path"),
])
def test_bad_values_from_env(tmp_path: Path, setting: str, value: str, rule: str) -> None:
    var = env_var_name(setting)
    msg = error(re.escape(setting), data_dir=tmp_path, env={var: value})
    assert f"(from {var}): {rule}" in msg


@pytest.mark.parametrize(("setting", "value"), [
    ("api.max_body_bytes", -1), ("api.max_batch", 0), ("api.max_list_limit", -5),
    ("api.default_list_limit", 0), ("api.max_event_subscribers", -1), ("api.event_queue_size", 0),
    ("limits.max_container_bytes", -1), ("limits.max_depth", 0), ("limits.max_clock_skew_seconds", -1),
    ("limits.max_decompressed_bytes", -1024), ("store.batch_max", 0), ("store.batch_wait_ms", -2),
    ("store.reader_threads", 0), ("peer.dht_port", -1), ("peer.discovery_port", 65536),
])
def test_negative_and_out_of_range_limits(tmp_path: Path, setting: str, value: int) -> None:
    section, key = setting.split(".")
    path = write_conf(tmp_path, f"[{section}]\n{key} = {value}\n")
    error(rf"^{re.escape(setting)} = {value} \(from {re.escape(str(path))}\): must be an integer \d+\.\.\d+$",
          data_dir=tmp_path)


def test_unknown_key_in_file(tmp_path: Path) -> None:
    path = write_conf(tmp_path, "[api]\nprot = 8080\n")
    msg = error(r"unknown setting", data_dir=tmp_path)
    assert msg == f"unknown setting [api] prot in {path}"


def test_unknown_section_in_file(tmp_path: Path) -> None:
    path = write_conf(tmp_path, "[apii]\nport = 8080\n")
    msg = error(r"unknown section", data_dir=tmp_path)
    assert msg == f"unknown section [apii] in {path}"


def test_top_level_key_in_file(tmp_path: Path) -> None:
    path = write_conf(tmp_path, 'data_dir = "/x"\n')
    error(rf"unknown setting data_dir in {re.escape(str(path))}", data_dir=tmp_path)


def test_section_not_a_table(tmp_path: Path) -> None:
    write_conf(tmp_path, "api = 5\n")
    error(r"\[api\] in .* must be a table", data_dir=tmp_path)


def test_invalid_toml(tmp_path: Path) -> None:
    path = write_conf(tmp_path, "[api\nport = 1\n")
    msg = error(rf"^invalid TOML in {re.escape(str(path))}: ", data_dir=tmp_path)
    assert "line 1" in msg  # tomllib's own message, with its position


def test_duplicate_key_is_invalid_toml(tmp_path: Path) -> None:
    write_conf(tmp_path, "[api]\nport = 1\nport = 2\n")
    error(r"^invalid TOML in .*hmpnode\.toml: ", data_dir=tmp_path)


def test_non_utf8_file(tmp_path: Path) -> None:
    tmp_path.joinpath("hmpnode.toml").write_bytes(b'[node]\nname = "\xff"\n')
    error(r"^invalid TOML in .*hmpnode\.toml: not UTF-8", data_dir=tmp_path)


def test_missing_explicit_config_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    msg = error(r"does not exist", data_dir=tmp_path, config_file=missing)
    assert msg == f"config file {missing} does not exist"


def test_missing_data_dir_file_is_fine(tmp_path: Path) -> None:
    assert load(tmp_path / "not-created-yet").data_dir == tmp_path / "not-created-yet"


def test_config_path_is_a_directory(tmp_path: Path) -> None:
    (tmp_path / "hmpnode.toml").mkdir()
    error(r"^cannot read config file .*hmpnode\.toml", data_dir=tmp_path)


def test_unknown_env_key_in_a_known_section(tmp_path: Path) -> None:
    msg = error(r"unknown setting", data_dir=tmp_path, env={"HMPNODE_API_PROT": "8080"})
    assert msg == "unknown setting [api] prot (from HMPNODE_API_PROT)"


@pytest.mark.parametrize("key", ["api.prot", "port", "apii.port", "api.port.x"])
def test_unknown_override(tmp_path: Path, key: str) -> None:
    error(rf"^unknown setting {re.escape(key)} \(from ", data_dir=tmp_path, overrides={key: 1})


def test_bad_value_is_reported_even_when_a_higher_layer_replaces_it(tmp_path: Path) -> None:
    write_conf(tmp_path, "[api]\nport = 70000\n")
    error(r"api\.port = 70000 \(from .*hmpnode\.toml\)", data_dir=tmp_path, env={"HMPNODE_API_PORT": "1"})


def test_default_list_limit_above_max(tmp_path: Path) -> None:
    msg = error(r"api\.default_list_limit", data_dir=tmp_path, env={"HMPNODE_API_MAX_LIST_LIMIT": "50"})
    assert msg == ("api.default_list_limit = 100 (from default): "
                   "must not exceed api.max_list_limit = 50 (from HMPNODE_API_MAX_LIST_LIMIT)")


def test_api_and_peer_port_clash(tmp_path: Path) -> None:
    error(r"peer\.port = 9000 .*must differ from api\.port = 9000",
          data_dir=tmp_path, overrides={"api.port": 9000, "peer.port": 9000})
    # different specific addresses may share a port number
    s = load(tmp_path, overrides={"api.port": 9000, "peer.port": 9000, "peer.host": "10.0.0.1"})
    assert s.peer.port == s.api.port == 9000


def test_errors_are_value_errors() -> None:
    assert issubclass(ConfigError, ValueError)


# --------------------------------------------------------------------------- verify limits


def test_verify_limits_maps_each_field(tmp_path: Path) -> None:
    s = load(tmp_path, env={
        "HMPNODE_LIMITS_MAX_CONTAINER_BYTES": "2048",
        "HMPNODE_LIMITS_MAX_DEPTH": "10",
        "HMPNODE_LIMITS_MAX_CLOCK_SKEW_SECONDS": "30",
        "HMPNODE_LIMITS_MAX_DECOMPRESSED_BYTES": "4096",
    })
    assert s.limits.verify_limits() == Limits(
        max_container_bytes=2048, max_depth=10, max_clock_skew=timedelta(seconds=30), max_decompressed_bytes=4096,
    )


def test_interests_section(tmp_path: Path) -> None:
    write_conf(tmp_path, '[interests]\nmode = "everything"\ntags = ["x", "x", "y"]\nsenders = ["did:hmp:agent:a"]\n')
    s = load(tmp_path)
    assert (s.interests.mode, s.interests.tags, s.interests.senders) == ("everything", ("x", "y"), ("did:hmp:agent:a",))
    assert load(tmp_path, env={"HMPNODE_INTERESTS_TOPICS": "ethics, mesh"}).interests.topics == ("ethics", "mesh")
    for text, message in (('senders = ["bob"]', "must list DIDs"), ('mode = "all"', "must be one of"),
                          (f'tags = ["{"x" * 129}"]', "1..128 printable"),
                          ('max_entries = 1\nclasses = ["goal", "task"]', "at most interests.max_entries = 1")):
        write_conf(tmp_path, f"[interests]\n{text}\n")
        with pytest.raises(ConfigError, match=message):
            load(tmp_path)


def test_circuit_settings_reach_the_mesh(tmp_path: Path) -> None:
    """[peer] circuit_* arrive in MeshSettings.circuit (in seconds); role circuit is a known role;
    a bad circuit_reserve is one clear error."""
    from hmpnode.daemon import mesh_settings

    conf = write_conf(tmp_path, '[node]\nroles = ["circuit"]\n[peer]\ncircuit_reservations_per_ip = 2\n'
                                'circuit_accept_ms = 1500\ncircuit_reserve = "always"\ncircuit_bytes = 1048576\n')
    m = mesh_settings(load(tmp_path, config_file=conf))
    assert m.roles == ("circuit",)
    c = m.circuit
    assert (c.max_reservations_per_ip, c.accept_seconds, c.reserve, c.circuit_bytes) == (2, 1.5, "always", 1048576)
    bad = write_conf(tmp_path, '[peer]\ncircuit_reserve = "sometimes"\n')
    with pytest.raises(ConfigError, match="circuit_reserve"):
        load(tmp_path, config_file=bad)


def test_run_flags_set_announced_addresses_and_static_peers(tmp_path: Path) -> None:
    """`hmpnode run --announce/--no-announce/--static` reach the same settings as the file
    and the environment (comma-separated, as HMPNODE_PEER_*), and beat them."""
    from hmpnode.daemon import RunOptions, settings_for

    write_conf(tmp_path, '[peer]\nannounce = ["tcp://192.0.2.1"]\n')
    options = RunOptions(data_dir=tmp_path, announce="tcp://203.0.113.7,udp://203.0.113.7:7421",
                         no_announce="172.16.0.0/12", static="tcp://relay.example.org:4100")
    s = settings_for(options, {})
    assert s.peer.announce == ("tcp://203.0.113.7", "udp://203.0.113.7:7421")
    assert s.peer.no_announce == ("172.16.0.0/12",) and s.peer.static == ("tcp://relay.example.org:4100",)
    assert settings_for(RunOptions(data_dir=tmp_path), {}).peer.announce == ("tcp://192.0.2.1",)
