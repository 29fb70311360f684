"""Persistent state for the objects the admin API manages (tenants, keys, pipelines, ...).

Callers depend on the StateStore contract only; SQLite backs it on one replica,
and another backend (Redis) can implement the same contract for several.
"""

from sitsmesh.state.contract import Delete, Put, Record, StateStore
from sitsmesh.state.sqlite import SqliteStore

__all__ = ["Delete", "Put", "Record", "SqliteStore", "StateStore"]
