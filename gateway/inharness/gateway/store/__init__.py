"""Durable store of the gateway (SQLite embedded default; PostgreSQL for several gateway processes)."""

from inharness.gateway.store.base import (
    AttemptAuth,
    AttemptEnded,
    CallRecord,
    Conflict,
    NotFound,
    ParentCall,
    StoreError,
)
from inharness.gateway.store.migrations import SchemaTooNew
from inharness.gateway.store.store import Store

__all__ = [
    "AttemptAuth",
    "AttemptEnded",
    "CallRecord",
    "Conflict",
    "NotFound",
    "ParentCall",
    "SchemaTooNew",
    "Store",
    "StoreError",
]
