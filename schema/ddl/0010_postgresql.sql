-- correlation-worker schema, revision 0010, PostgreSQL: the delivery record and the deduplication window.
--
-- A message that leaves the table (correlated, expired, deleted by an operator) stays as a record for
-- CORRELATION_DELIVERY__RETENTION (default P7D): its row turns to state 'delivered', keeping id, message_id,
-- message_name, correlation_hint, created_at, attempt and reschedule_count, with the outcome, the target's
-- answer, when and by which replica it finished; its payload and headers are dropped ('{}'). Because the record
-- is the same row, message_id's unique index keeps refusing the id inside the window, to a plain INSERT (unique
-- violation) and to INSERT ... ON CONFLICT (message_id) DO NOTHING (nothing inserted) alike. Records past the
-- retention are deleted in bounded chunks; with a retention of PT0S rows are deleted at once, as before.
ALTER TABLE correlation_message
    -- How the message left: 'correlated', 'expired' or 'deleted' (by an operator); NULL while it is live.
    ADD COLUMN outcome     text,
    -- The correlator's answer on success (a process instance key, a response body), JSON, at most 2 000 chars.
    ADD COLUMN result      jsonb,
    -- When it left (the database clock) and which replica recorded it (correlation_lock.locked_by, or the
    -- operator's name for a deletion).
    ADD COLUMN finished_at timestamptz,
    ADD COLUMN finished_by text;

ALTER TABLE correlation_message DROP CONSTRAINT correlation_message_state_known;
ALTER TABLE correlation_message ADD CONSTRAINT correlation_message_state_known
    CHECK (state IN ('ready', 'paused', 'dead', 'delivered'));
-- A record has its outcome and end; a live message has neither.
ALTER TABLE correlation_message ADD CONSTRAINT correlation_message_record_complete
    CHECK ((state = 'delivered') = (outcome IS NOT NULL AND finished_at IS NOT NULL));
ALTER TABLE correlation_message ADD CONSTRAINT correlation_message_outcome_known
    CHECK (outcome IN ('correlated', 'expired', 'deleted'));

-- Records stay out of the indexes the engine and the console read for live messages: a record then costs the
-- primary key, message_id's unique index (the window) and the index of its end, nothing more. A hint's paused
-- and dead messages (what holds it back):
DROP INDEX correlation_message_hint_held_idx;
CREATE INDEX correlation_message_hint_held_idx ON correlation_message (correlation_hint, state, id)
    WHERE state IN ('paused', 'dead');
-- Paused and dead messages in id order (the console's lists by state):
DROP INDEX correlation_message_held_state_idx;
CREATE INDEX correlation_message_held_state_idx ON correlation_message (state, id) WHERE state IN ('paused', 'dead');
-- A name's live messages by state in id order (records by name are read in id order from the primary key, past
-- the few live rows among them):
DROP INDEX correlation_message_name_state_id_idx;
CREATE INDEX correlation_message_name_state_id_idx ON correlation_message (message_name, state, id)
    WHERE state <> 'delivered';
-- Records by the time they finished: the retention's cleanup.
CREATE INDEX correlation_message_finished_idx ON correlation_message (finished_at, id)
    WHERE state = 'delivered';
