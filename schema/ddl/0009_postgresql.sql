-- correlation-worker schema, revision 0009, PostgreSQL: samples behind the console's charts.
--
-- Every replica writes one row per CORRELATION_METRICS__GAUGES_INTERVAL with its own cumulative counts of
-- correlator calls by outcome since it started; the replica holding the census lock (one at a time) adds the
-- table's census to its row: messages by state, the oldest eligible message's age, and the id sequence (every
-- message inserted so far). The console reads these rows to draw the same picture on every replica: inserted
-- and correlated per second, retries and dead per minute, backlog by state, oldest age, calls per replica.
-- Rows older than a day (and an hour) are removed in bounded chunks by the census holder.
CREATE TABLE correlation_sample (
    taken_at      timestamptz NOT NULL DEFAULT now(),
    -- correlation_lock.locked_by of the replica (the pod name and a per-boot suffix).
    replica       text NOT NULL,
    -- The replica's correlator calls since it started, by outcome (correlation_messages_total's outcomes).
    success       bigint NOT NULL DEFAULT 0,
    retry         bigint NOT NULL DEFAULT 0,
    buffered      bigint NOT NULL DEFAULT 0,
    rescheduled   bigint NOT NULL DEFAULT 0,
    dead          bigint NOT NULL DEFAULT 0,
    -- The census, on the census holder's rows only (NULL on the others').
    inserted_total    bigint,
    ready             bigint,
    waiting           bigint,
    paused            bigint,
    dead_messages     bigint,
    expired           bigint,
    oldest_eligible_seconds double precision,
    PRIMARY KEY (taken_at, replica)
);
-- The console reads the last day's rows, and cleanup removes the older ones, by time.
CREATE INDEX correlation_sample_replica_idx ON correlation_sample (replica, taken_at);
