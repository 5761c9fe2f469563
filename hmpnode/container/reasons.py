"""Reason codes of HMP profile section 7, in verification order.

These strings are part of the wire contract: the node returns them to
whoever submitted a container, logs them and counts them in metrics.
"""

MALFORMED = "malformed"
SCHEMA = "schema"
FUTURE_TIMESTAMP = "future_timestamp"
PAYLOAD_HASH_MISMATCH = "payload_hash_mismatch"
CONTAINER_DID_MISMATCH = "container_did_mismatch"
KEY_MISMATCH = "key_mismatch"
UNKNOWN_KEY = "unknown_key"
REVOKED = "revoked"
UNSUPPORTED_SIG_ALGO = "unsupported_sig_algo"
BAD_SIGNATURE = "bad_signature"
CLASS_SCHEMA = "class_schema"

#: Every reject reason, in the order verification checks them.
ALL = (
    MALFORMED,
    SCHEMA,
    FUTURE_TIMESTAMP,
    PAYLOAD_HASH_MISMATCH,
    CONTAINER_DID_MISMATCH,
    KEY_MISMATCH,
    UNKNOWN_KEY,
    REVOKED,
    UNSUPPORTED_SIG_ALGO,
    BAD_SIGNATURE,
    CLASS_SCHEMA,
)
