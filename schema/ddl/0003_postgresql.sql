-- correlation-worker schema, revision 0003, PostgreSQL: the engine's hint lanes, the commit-order horizon,
-- wake-ups, poison messages, durable pauses, and limits on what a row may hold.

-- Rows written by hand before this revision that the worker could not read or record are dead-lettered
-- first (with the reason in last_error), so that the constraints below can hold for every row.
UPDATE correlation_message
   SET state = 'dead', next_attempt_at = NULL,
       last_error = 'dead-lettered by the schema upgrade: next_attempt_at ' || next_attempt_at::text
                    || ' cannot be read (it must be a finite time between the years 1 and 9999)'
 WHERE next_attempt_at IS NOT NULL
   AND NOT (isfinite(next_attempt_at) AND next_attempt_at >= '0001-01-02 00:00:00+00'
            AND next_attempt_at < '9999-12-31 00:00:00+00');
UPDATE correlation_message
   SET state = 'dead',
       last_error = 'dead-lettered by the schema upgrade: created_at ' || created_at::text
                    || ' is before the year 1 and cannot be read',
       created_at = '0001-01-02 00:00:00+00'
 WHERE created_at < '0001-01-02 00:00:00+00';
UPDATE correlation_message
   SET state = 'dead', last_error = 'dead-lettered by the schema upgrade: attempt ' || attempt::text
                                   || ' is over the limit of 1000000000'
 WHERE attempt > 1000000000 OR reschedule_count > 1000000000;
UPDATE correlation_message SET attempt = 1000000000 WHERE attempt > 1000000000;
UPDATE correlation_message SET reschedule_count = 1000000000 WHERE reschedule_count > 1000000000;

ALTER TABLE correlation_message
    -- Calls of this message whose outcome was never recorded because their replica died or lost its lease,
    -- since its last recorded outcome. A message with lost calls is delivered again one call at a time,
    -- each call marked before it starts, and every such call counts as a redelivery.
    ADD COLUMN lost_calls integer NOT NULL DEFAULT 0,
    -- Of the lost calls, those that were running alone when their replica died: the correlator may be what
    -- kills the process. At the policy's poison_after the message is dead.
    ADD COLUMN crashed_calls integer NOT NULL DEFAULT 0,
    -- The durable pause (correlation_pause.id) that paused this message; lifting the pause resumes it.
    ADD COLUMN pause_id bigint,
    ADD CONSTRAINT correlation_message_next_attempt_at_readable CHECK (
        isfinite(next_attempt_at) AND next_attempt_at >= '0001-01-02 00:00:00+00'
        AND next_attempt_at < '9999-12-31 00:00:00+00'),
    ADD CONSTRAINT correlation_message_created_at_after_year_1 CHECK (created_at >= '0001-01-02 00:00:00+00'),
    ADD CONSTRAINT correlation_message_attempt_at_most_a_billion CHECK (attempt <= 1000000000),
    ADD CONSTRAINT correlation_message_reschedule_count_at_most_a_billion CHECK (reschedule_count <= 1000000000),
    ADD CONSTRAINT correlation_message_lost_calls_in_range CHECK (lost_calls BETWEEN 0 AND 1000000000),
    ADD CONSTRAINT correlation_message_crashed_calls_in_range CHECK (crashed_calls BETWEEN 0 AND lost_calls),
    -- A page holds at most page_size messages: with these limits it never holds unbounded bytes.
    ADD CONSTRAINT correlation_message_payload_at_most_1_mib CHECK (octet_length(payload::text) <= 1048576),
    ADD CONSTRAINT correlation_message_headers_at_most_64_kib CHECK (octet_length(headers::text) <= 65536);

-- Indexes of the engine. A slot's hints with fresh messages are found by a loose index scan (one probe per
-- hint, however many messages a hint has queued); a hint's batch is read in id order; what holds a hint back
-- (a waiting retry, a paused or dead message) is one probe each.
DROP INDEX correlation_message_fresh_idx;
DROP INDEX correlation_message_blocking_idx;
CREATE INDEX correlation_message_fresh_hint_idx ON correlation_message (slot, correlation_hint)
    WHERE state = 'ready' AND next_attempt_at IS NULL;
CREATE INDEX correlation_message_hint_ready_idx ON correlation_message (correlation_hint, id)
    WHERE state = 'ready';
CREATE INDEX correlation_message_hint_delayed_idx ON correlation_message (correlation_hint, id)
    WHERE state = 'ready' AND next_attempt_at IS NOT NULL;
CREATE INDEX correlation_message_hint_held_idx ON correlation_message (correlation_hint, state, id)
    WHERE state <> 'ready';
CREATE INDEX correlation_message_pause_idx ON correlation_message (pause_id) WHERE pause_id IS NOT NULL;

-- Durable pauses: a message name, a hint, or everything, held back until the pause is lifted (also messages
-- inserted after it). A paused name's messages are paused (pause_id set) as the worker meets them.
CREATE TABLE correlation_pause (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- 'all', 'name' (target is a message_name) or 'hint' (target is a correlation_hint).
    scope       text NOT NULL,
    target      text NOT NULL DEFAULT '',
    reason      text NOT NULL DEFAULT '',
    -- Who paused: the operator's token name, or the database user for SQL.
    created_by  text NOT NULL DEFAULT current_user,
    created_at  timestamptz NOT NULL DEFAULT now(),
    CONSTRAINT correlation_pause_scope_known CHECK (scope IN ('all', 'name', 'hint')),
    CONSTRAINT correlation_pause_target_matches_scope CHECK ((scope = 'all') = (target = '')),
    CONSTRAINT correlation_pause_target_length CHECK (length(target) <= 255),
    CONSTRAINT correlation_pause_reason_length CHECK (length(reason) <= 1000),
    CONSTRAINT correlation_pause_once UNIQUE (scope, target)
);

-- The version of a lease's in-flight marks: writes racing each other (a lane's mark, a flush of outcomes)
-- replace the marks only when newer, so that a late write never undoes a newer one.
ALTER TABLE correlation_lock ADD COLUMN in_flight_version bigint NOT NULL DEFAULT 0;

-- Every slot's lease row exists from the start, free: taking a slot is an UPDATE of rows that are never
-- inserted concurrently, so acquisition never waits on another replica's uncommitted work.
INSERT INTO correlation_lock (name, lock_until, locked_at, locked_by, fence)
SELECT 'slot:' || n, now(), now(), '', 0 FROM generate_series(0, 63) AS n
    ON CONFLICT (name) DO NOTHING;

-- Commit order. An id is taken at INSERT but becomes visible at COMMIT, so producers can commit out of id
-- order. Before a producer transaction takes its first id it registers: it holds a shared advisory lock whose
-- key carries the last id handed out so far (every id it takes is larger). The worker correlates only ids up
-- to the smallest such registration still held (or the sequence's last value when there is none): every id
-- at or below it belongs to a finished transaction. Nothing waits on these locks; they end with the
-- transaction (or the savepoint that took them).
CREATE FUNCTION correlation_message_register_producer() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    last_id bigint;
BEGIN
    IF current_setting('correlation_worker.producer', true) IS DISTINCT FROM 'registered' THEN
        last_id := coalesce(pg_sequence_last_value(pg_get_serial_sequence(
            quote_ident(TG_TABLE_SCHEMA) || '.' || quote_ident(TG_TABLE_NAME), 'id')::regclass), 0);
        -- Key: 0x6377 in the top 16 bits, the last id in the low 48.
        PERFORM pg_advisory_xact_lock_shared((25463::bigint << 48) | least(last_id, 281474976710655));
        PERFORM set_config('correlation_worker.producer', 'registered', true);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER correlation_message_register_producer BEFORE INSERT ON correlation_message
    FOR EACH STATEMENT EXECUTE FUNCTION correlation_message_register_producer();

-- The worker's view of the registrations: the sequence's last value, then (read after it) the registrations
-- still held, each with the transaction holding it.
CREATE FUNCTION correlation_order_horizon(OUT last_id bigint, OUT pin_ids bigint[], OUT pin_holders text[])
    LANGUAGE plpgsql AS $$
BEGIN
    last_id := coalesce(pg_sequence_last_value(pg_get_serial_sequence('correlation_message', 'id')::regclass), 0);
    SELECT array_agg(((l.classid::bigint & 65535) << 32) | l.objid::bigint),
           array_agg(l.virtualtransaction)
      INTO pin_ids, pin_holders
      FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
       AND l.classid::bigint BETWEEN 1668743168 AND 1668808703
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());
END
$$;

-- Wake-ups: one NOTIFY per producer statement naming the slots it inserted into. Turn it off (e.g. behind a
-- transaction-mode pooler) with ALTER TABLE correlation_message DISABLE TRIGGER correlation_message_notify.
CREATE FUNCTION correlation_message_notify() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    slots text;
BEGIN
    SELECT string_agg(DISTINCT slot::text, ',') INTO slots FROM inserted;
    IF slots IS NOT NULL THEN
        PERFORM pg_notify('correlation_message', slots);
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER correlation_message_notify AFTER INSERT ON correlation_message
    REFERENCING NEW TABLE AS inserted FOR EACH STATEMENT EXECUTE FUNCTION correlation_message_notify();
