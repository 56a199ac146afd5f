-- correlation-worker schema, revision 0007, PostgreSQL: calls in flight, one row per call.
--
-- Before a replica calls a correlator for a message, it writes the call here, under the term of the slot lease
-- it works under (slot, fence). The row leaves in the transaction that records the call's outcome, and only if
-- it is still there with that term: a term that ended may have had its calls taken over meanwhile, and then
-- its late outcome is not written. A replica that takes a slot over finds the calls of ended terms here, each
-- row one call whose outcome was never recorded: it counts it once (the row leaves as it is counted) and
-- delivers the message again. A message with a row here is never fetched: it is in flight, or its lost call is
-- still to be counted.
--
-- The table holds only calls under way (a few per lane); operators may read it, and should not write it.
CREATE TABLE correlation_call (
    -- The message called (no foreign key: marking a call never waits on a lock of the message row).
    message_id  bigint PRIMARY KEY,
    -- The lease term the call is made under: slot:<slot> of correlation_lock with this fence.
    slot        integer NOT NULL,
    fence       bigint NOT NULL,
    -- The replica making it (correlation_lock.locked_by of that term).
    holder      text NOT NULL,
    -- The first message of the run the call belongs to: a lane marks several calls of one hint at once and
    -- makes them in id order, so after a crash the run's first call still here is the one that was under way.
    run_head    bigint NOT NULL,
    -- called: marked, under way or about to be; alone: called with no other call running in its replica (a
    -- crash then is this message's doing); returned: the call returned, its outcome waits for a row lock;
    -- abandoned: given up on at shutdown (delivered again, never blamed).
    state       text NOT NULL DEFAULT 'called',
    marked_at   timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT correlation_call_state_known CHECK (state IN ('called', 'alone', 'returned', 'abandoned'))
);
CREATE INDEX correlation_call_term_idx ON correlation_call (slot, fence);

-- Marks of revision 0002/0003 (one JSON value per lease row) become call rows: nothing in flight is forgotten.
INSERT INTO correlation_call (message_id, slot, fence, holder, run_head, state)
SELECT DISTINCT ON (call.id) call.id, substr(l.name, 6)::integer, l.fence, l.locked_by, call.head, call.state
  FROM correlation_lock l
 CROSS JOIN LATERAL (
       SELECT (run.value ->> (position.index - 1)::integer)::bigint AS id, (run.value ->> 0)::bigint AS head,
              CASE WHEN l.in_flight::jsonb -> 'alone' @> to_jsonb((run.value ->> (position.index - 1)::integer)::bigint)
                   THEN 'alone' ELSE 'called' END AS state
         FROM jsonb_array_elements(CASE jsonb_typeof(l.in_flight::jsonb)
                                       WHEN 'array' THEN jsonb_build_array(l.in_flight::jsonb)
                                       ELSE COALESCE(l.in_flight::jsonb -> 'runs', '[]') END) AS run(value)
        CROSS JOIN LATERAL generate_series(1, jsonb_array_length(run.value)) AS position(index)
       UNION ALL
       SELECT abandoned.value::bigint, abandoned.value::bigint, 'abandoned'
         FROM jsonb_array_elements_text(CASE jsonb_typeof(l.in_flight::jsonb)
                                            WHEN 'object' THEN COALESCE(l.in_flight::jsonb -> 'abandoned', '[]')
                                            ELSE '[]' END) AS abandoned(value)
      ) AS call
 WHERE l.name LIKE 'slot:%' AND l.in_flight IS NOT NULL AND l.in_flight <> ''
 ORDER BY call.id, call.state = 'abandoned' DESC;

ALTER TABLE correlation_lock DROP COLUMN in_flight;
ALTER TABLE correlation_lock DROP COLUMN in_flight_version;

-- Console sessions ended at logout, before their expiry: a cookie copied before the logout opens nothing after
-- it, on any replica. A digest of the session's nonce (never the cookie), kept until the session would have
-- expired; rows past that are removed at the next logout.
CREATE TABLE correlation_session_end (
    nonce_digest text PRIMARY KEY,
    expires_at   timestamptz NOT NULL
);
