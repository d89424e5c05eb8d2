"""Tables of the gateway store (SQLAlchemy Core; portable between SQLite and PostgreSQL): the schema as
it is now. How a store gets there is `migrations.py`; a test checks that both agree."""

from sqlalchemy import (
    JSON,
    BigInteger,
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

# 64-bit on PostgreSQL; SQLite's INTEGER is 64-bit already and must stay INTEGER to be its rowid.
CallId = BigInteger().with_variant(Integer(), "sqlite")

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
    # Position in the export stream, taken from `counters` when the rollout reaches a final status.
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
    # The key the claimer chose for its claim request: a claim repeated with it (the answer was lost)
    # gets these attempts again instead of new ones.
    Column("claim_key", String(64), index=True),
    Index("ix_attempts_lease", "status", "lease_expires_at"),
)

# A reward the harness posted for its own attempt (the latest post).
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
    Column("id", CallId, primary_key=True, autoincrement=True),
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
    Column("parent_call_id", CallId),
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
    # What of the request the prompt left out, and why (a tool type the model cannot run, ...).
    Column("notes", JSON),
    # Digest of the turns after this call's reply, without system messages and tools
    # (Conversation.turns_chain): tells a changed system prompt from a rewritten history.
    Column("turns_digest", String(32)),
    # A continuation (prefix_reused) stores only what its prompt adds: its first `prompt_prefix` tokens
    # are its parent's prompt and response, and `prompt_ids` holds the rest, so an attempt's storage
    # grows with its conversation, not its square. Null: `prompt_ids` is the whole prompt.
    Column("prompt_prefix", Integer),
    # Likewise the request body: a continuation's conversation list (`messages`, else `input`) holds only
    # the items after its parent's whole list, which are its first `body_prefix` items. Null: the body
    # is stored whole. `body_items` and `body_digest` are the length and digest of this call's whole
    # list, so that a child checks that its list extends this one without reading it (store.py).
    # `request_body` and `response_body` hold JSON null when the gateway keeps no bodies.
    Column("body_prefix", Integer),
    Column("body_items", Integer),
    Column("body_digest", String(32)),
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

# Counters handed out under a row lock held until commit (`UPDATE ... RETURNING`): `finish_seq` numbers
# the export stream, `created_seq` the claim order. A transaction takes its number only after the one
# before it committed, so an exporter never sees number n+1 before n, whichever process wrote them.
counters = Table(
    "counters",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("value", BigInteger, nullable=False),
)

# Serving state shared by every gateway process (one row, id 1): a pause or resume is written here first
# and applied by each process within its poll (app.py); `generation` counts the changes, so a process
# knows whether it has applied the latest one.
serving = Table(
    "serving",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("paused", Boolean, nullable=False),
    Column("resumes_at", Float),
    Column("generation", BigInteger, nullable=False),
)

# Each live gateway process, as it last reported itself: a pause waits for every process seen lately
# to have applied it and drained, and GET /serving sums their calls.
gateway_workers = Table(
    "gateway_workers",
    metadata,
    Column("id", String(40), primary_key=True),
    Column("host", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("seen_at", Float, nullable=False),
    Column("generation", BigInteger, nullable=False),
    Column("in_flight", Integer, nullable=False),
    Column("held", Integer, nullable=False),
)

# The trainer's progress board (progress.py), one row (id 1), so that every process answers the same.
progress = Table(
    "progress",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=False),
    Column("board", JSON, nullable=False),
)

# One row per migration applied (migrations.py): the store's schema version is the highest.
schema_version = Table(
    "schema_version",
    metadata,
    Column("version", Integer, primary_key=True, autoincrement=False),
    Column("name", Text, nullable=False),
    Column("applied_at", Float, nullable=False),
)
