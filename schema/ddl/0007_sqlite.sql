-- correlation-worker schema, revision 0007, SQLite: calls in flight, one row per call (see the PostgreSQL
-- file for what each column means), and the slot of every message is 0 (one replica owns the file).
CREATE TABLE correlation_call (
    message_id  INTEGER PRIMARY KEY,
    slot        INTEGER NOT NULL,
    fence       INTEGER NOT NULL,
    holder      TEXT NOT NULL,
    run_head    INTEGER NOT NULL,
    state       TEXT NOT NULL DEFAULT 'called',
    marked_at   TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now')),
    CONSTRAINT correlation_call_state_known CHECK (state IN ('called', 'alone', 'returned', 'abandoned'))
);
CREATE INDEX correlation_call_term_idx ON correlation_call (slot, fence);

INSERT OR IGNORE INTO correlation_call (message_id, slot, fence, holder, run_head, state)
SELECT abandoned.value, 0, l.fence, l.locked_by, abandoned.value, 'abandoned'
  FROM correlation_lock l, json_each(l.in_flight, '$.abandoned') AS abandoned
 WHERE l.name = 'slot:0' AND json_valid(l.in_flight) AND json_type(l.in_flight) = 'object';
INSERT OR IGNORE INTO correlation_call (message_id, slot, fence, holder, run_head, state)
SELECT call.value, 0, l.fence, l.locked_by, json_extract(run.value, '$[0]'),
       CASE WHEN EXISTS (SELECT 1 FROM json_each(l.in_flight, '$.alone') AS a WHERE a.value = call.value)
            THEN 'alone' ELSE 'called' END
  FROM correlation_lock l, json_each(l.in_flight, '$.runs') AS run, json_each(run.value) AS call
 WHERE l.name = 'slot:0' AND json_valid(l.in_flight) AND json_type(l.in_flight) = 'object';
INSERT OR IGNORE INTO correlation_call (message_id, slot, fence, holder, run_head, state)
SELECT call.value, 0, l.fence, l.locked_by, json_extract(l.in_flight, '$[0]'), 'called'
  FROM correlation_lock l, json_each(l.in_flight) AS call
 WHERE l.name = 'slot:0' AND json_valid(l.in_flight) AND json_type(l.in_flight) = 'array';

ALTER TABLE correlation_lock DROP COLUMN in_flight;
ALTER TABLE correlation_lock DROP COLUMN in_flight_version;

-- Every message of the file is in slot 0: a row written with another slot would never be fetched.
UPDATE correlation_message SET slot = 0 WHERE slot <> 0;
CREATE TRIGGER correlation_message_slot_is_0_insert BEFORE INSERT ON correlation_message
    WHEN NEW.slot <> 0
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_slot_is_0: on SQLite every message is in slot 0 (leave slot out)');
END;
CREATE TRIGGER correlation_message_slot_is_0_update BEFORE UPDATE OF slot ON correlation_message
    WHEN NEW.slot <> 0
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_slot_is_0: on SQLite every message is in slot 0 (leave slot out)');
END;

-- Console sessions ended at logout, before their expiry (see the PostgreSQL file).
CREATE TABLE correlation_session_end (
    nonce_digest TEXT PRIMARY KEY,
    expires_at   TEXT NOT NULL
);
