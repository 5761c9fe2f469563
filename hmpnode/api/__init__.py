"""The local agent API (HTTP + JSON, bearer token): see `hmpnode.api.app`."""

from hmpnode.api.app import SERVER_OPTIONS, ApiLimits, create_app

__all__ = ["ApiLimits", "create_app", "SERVER_OPTIONS"]
