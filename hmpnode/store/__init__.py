"""The node's durable store: SQLite (WAL), one batching writer, pooled readers."""

from hmpnode.store.db import Database, DatabaseClosed, StorageFull

__all__ = ["Database", "DatabaseClosed", "StorageFull"]
