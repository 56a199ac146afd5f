-- correlation-worker schema, revision 0009, SQLite: samples behind the console's charts (see the PostgreSQL file).
CREATE TABLE correlation_sample (
    taken_at      TEXT NOT NULL,
    replica       TEXT NOT NULL,
    success       INTEGER NOT NULL DEFAULT 0,
    retry         INTEGER NOT NULL DEFAULT 0,
    buffered      INTEGER NOT NULL DEFAULT 0,
    rescheduled   INTEGER NOT NULL DEFAULT 0,
    dead          INTEGER NOT NULL DEFAULT 0,
    inserted_total    INTEGER,
    ready             INTEGER,
    waiting           INTEGER,
    paused            INTEGER,
    dead_messages     INTEGER,
    expired           INTEGER,
    oldest_eligible_seconds REAL,
    PRIMARY KEY (taken_at, replica)
);
CREATE INDEX correlation_sample_replica_idx ON correlation_sample (replica, taken_at);
