"""Durable store of the gateway (SQLite embedded default; portable SQL for PostgreSQL)."""

from inharness.gateway.store.store import (
    AttemptAuth,
    CallRecord,
    Conflict,
    NotFound,
    ParentCall,
    Store,
    StoreError,
)

__all__ = ["AttemptAuth", "CallRecord", "Conflict", "NotFound", "ParentCall", "Store", "StoreError"]
