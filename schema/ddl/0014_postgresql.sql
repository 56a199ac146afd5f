-- correlation-worker schema, revision 0014, PostgreSQL: the network targets' states, as each replica sees them.
--
-- A replica writes a row per destination it calls (a route's URL or engine address) when its state changes and
-- every 30 seconds besides; `status`, the API and the console's overview read the fresh ones. A replica that
-- stops deletes its rows; a dead one's age out (seen_at).
CREATE TABLE correlation_target (
    -- correlation_lock.locked_by of the replica (the pod name and a per-boot suffix).
    replica           text NOT NULL,
    -- The destination as logs show it (credentials redacted).
    target            text NOT NULL,
    -- closed, open or half_open.
    circuit           text NOT NULL,
    -- Why it is open (the answer that opened it); empty when closed.
    reason            text NOT NULL DEFAULT '',
    -- Calls allowed in flight now (lowered by back-pressure), and in flight now.
    concurrency_limit integer NOT NULL,
    in_flight         integer NOT NULL,
    -- Since when the circuit has been in this state (the database's clock when the replica first wrote it).
    since             timestamptz NOT NULL DEFAULT now(),
    seen_at           timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (replica, target)
);
