"""Agent and node identities: keys, DIDs, keystore files."""

from hmpnode.identity.keys import (
    AGENT_DID_PREFIX,
    Identity,
    Rng,
    agent_did_for_key,
    did_matches_key,
    ed25519_pk_to_x25519,
    ed25519_verify,
    is_self_certifying_did,
    public_key_from_b58,
)

__all__ = [
    "AGENT_DID_PREFIX",
    "Identity",
    "Rng",
    "agent_did_for_key",
    "did_matches_key",
    "ed25519_pk_to_x25519",
    "ed25519_verify",
    "is_self_certifying_did",
    "public_key_from_b58",
]

from hmpnode.identity.registry import KeyBinding, KeyRegistry, MemoryKeyRegistry, bind_key  # noqa: E402

__all__ += ["KeyBinding", "KeyRegistry", "MemoryKeyRegistry", "bind_key"]

from hmpnode.identity.keystore import KeystoreError, load_keystore, save_keystore  # noqa: E402

__all__ += ["KeystoreError", "load_keystore", "save_keystore"]
