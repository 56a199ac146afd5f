-- correlation-worker schema, revision 0017, PostgreSQL: what each replica routes and the settings it runs with.
--
-- A replica writes its row every lease renewal and deletes it when it stops; a dead one's ages out (seen_at). A
-- replica calls a message only when every live replica would send its name to the same route: a name routed
-- differently (a rolling update that changes routes, a replica started without CORRELATION_CORRELATORS) waits,
-- uncharged, until they agree. Settings whose effect is cluster-wide are compared and their differences shown.
CREATE TABLE correlation_replica (
    -- correlation_lock.locked_by of the replica (the pod name and a per-boot suffix).
    replica  text PRIMARY KEY,
    -- JSON object: route key (a message name or *) -> digest of the route as logs show it (credentials redacted).
    routes   text NOT NULL,
    -- JSON object: a cluster-wide setting's name -> its value as the replica runs with it.
    settings text NOT NULL,
    seen_at  timestamptz NOT NULL DEFAULT now()
);
