"""Tables of the gateway store (SQLAlchemy Core; portable between SQLite and PostgreSQL)."""

from sqlalchemy import (
    JSON,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)

metadata = MetaData()

rollouts = Table(
    "rollouts",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("group_id", String(40), nullable=False, index=True),
    Column("pool", String(253), nullable=False),
    Column("task", JSON, nullable=False),
    Column("labels", JSON, nullable=False),
    Column("status", String(16), nullable=False),
    Column("reward", Float),
    Column("max_attempts", Integer, nullable=False),
    Column("attempts_started", Integer, nullable=False, default=0),
    Column("created_seq", Integer, nullable=False),
    Column("created_at", Float, nullable=False),
    Column("finished_at", Float),
    # Monotonic position in the export stream, assigned when the rollout reaches a final status.
    Column("finish_seq", Integer, unique=True),
    Index("ix_rollouts_claim", "pool", "status", "created_seq"),
)

attempts = Table(
    "attempts",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("rollout_id", String(40), ForeignKey("rollouts.id"), nullable=False, index=True),
    Column("seq", Integer, nullable=False),
    Column("pool", String(253), nullable=False),
    # sha256 of the attempt's API key: the key itself is handed out once, at claim.
    Column("token_hash", String(64), nullable=False, unique=True),
    Column("status", String(16), nullable=False),
    Column("lease_seconds", Float, nullable=False),
    Column("claimed_at", Float, nullable=False),
    Column("lease_expires_at", Float, nullable=False),
    Column("finished_at", Float),
    Column("reward", Float),
    Column("failure_reason", Text),
    Column("info", JSON, nullable=False),
    Index("ix_attempts_lease", "status", "lease_expires_at"),
)

# A reward the harness posted for its own attempt (the latest post); its own table, so that an existing
# store gains it through create_all without a migration.
posted_rewards = Table(
    "posted_rewards",
    metadata,
    Column("attempt_id", String(40), ForeignKey("attempts.id"), primary_key=True),
    Column("reward", Float, nullable=False),
    Column("info", JSON, nullable=False),
    Column("posted_at", Float, nullable=False),
    Column("posts", Integer, nullable=False),
)

calls = Table(
    "calls",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("attempt_id", String(40), ForeignKey("attempts.id"), nullable=False),
    Column("rollout_id", String(40), nullable=False),
    Column("request_id", String(64), nullable=False),
    Column("choice_index", Integer, nullable=False),
    Column("protocol", String(32), nullable=False),
    Column("requested_model", Text, nullable=False),
    Column("model_version", Integer, nullable=False),
    Column("engine", Text, nullable=False),
    Column("prompt_ids", LargeBinary, nullable=False),
    Column("response_ids", LargeBinary, nullable=False),
    Column("response_logprobs", LargeBinary, nullable=False),
    Column("finish_reason", String(16), nullable=False),
    Column("parent_call_id", Integer),
    Column("prefix_reused", Boolean, nullable=False),
    Column("prefix_mismatch", String(64)),
    # Digests of the conversation before and after this call; how a later turn finds its parent.
    Column("request_digest", String(32), nullable=False),
    Column("reply_digest", String(32), nullable=False),
    Column("started_at", Float, nullable=False),
    Column("first_token_at", Float),
    Column("finished_at", Float, nullable=False),
    Column("request_body", JSON, nullable=False),
    Column("response_body", JSON, nullable=False),
    # What of the request the prompt left out, and why (a tool type the model cannot run, ...);
    # added after the first stores were made: Store.open adds it to an older store.
    Column("notes", JSON),
    # Digest of the turns after this call's reply, without system messages and tools
    # (Conversation.turns_chain): tells a changed system prompt from a rewritten history. Added later.
    Column("turns_digest", String(32)),
    Index("ix_calls_attempt", "attempt_id", "id"),
    Index("ix_calls_reply", "attempt_id", "reply_digest"),
    Index("ix_calls_request", "attempt_id", "request_digest"),
)

model_versions = Table(
    "model_versions",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("engines", JSON, nullable=False),
    Column("active", Boolean, nullable=False),
    Column("created_at", Float, nullable=False),
)
