"""The local agent API (HTTP + JSON, bearer token): see `hmpnode.api.app`."""

from hmpnode.api.app import ApiLimits, create_app
from hmpnode.serving import SERVER_OPTIONS

__all__ = ["ApiLimits", "create_app", "SERVER_OPTIONS"]
