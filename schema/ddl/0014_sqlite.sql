-- correlation-worker schema, revision 0014, SQLite: the network targets' states, as each replica sees them (see
-- the PostgreSQL revision for what the columns hold).
CREATE TABLE correlation_target (
    replica           TEXT NOT NULL,
    target            TEXT NOT NULL,
    circuit           TEXT NOT NULL,
    reason            TEXT NOT NULL DEFAULT '',
    concurrency_limit INTEGER NOT NULL,
    in_flight         INTEGER NOT NULL,
    since             TEXT NOT NULL,
    seen_at           TEXT NOT NULL,
    PRIMARY KEY (replica, target)
);
