-- correlation-worker schema, revision 0003, SQLite: the same columns and limits as on PostgreSQL (lost and
-- crashed calls, durable pauses, readable worker-owned values, payload and headers size). SQLite cannot add
-- constraints to a table, so the table is rebuilt; its id sequence carries over.

CREATE TABLE correlation_message_v3 (
    id                INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id        TEXT UNIQUE,
    message_name      TEXT NOT NULL,
    correlation_hint  TEXT NOT NULL,
    payload           TEXT NOT NULL DEFAULT '{}',
    headers           TEXT NOT NULL DEFAULT '{}',
    created_at        TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now')),
    time_to_live      REAL,
    expires_at        TEXT,
    attempt           INTEGER NOT NULL DEFAULT 0,
    next_attempt_at   TEXT,
    reschedule_count  INTEGER NOT NULL DEFAULT 0,
    last_error        TEXT,
    state             TEXT NOT NULL DEFAULT 'ready',
    slot              INTEGER NOT NULL DEFAULT 0,
    lost_calls        INTEGER NOT NULL DEFAULT 0,
    crashed_calls     INTEGER NOT NULL DEFAULT 0,
    pause_id          INTEGER,

    CONSTRAINT correlation_message_name_not_empty CHECK (message_name <> ''),
    CONSTRAINT correlation_message_name_length CHECK (length(message_name) <= 255),
    CONSTRAINT correlation_message_hint_not_empty CHECK (correlation_hint <> ''),
    CONSTRAINT correlation_message_hint_length CHECK (length(correlation_hint) <= 255),
    CONSTRAINT correlation_message_message_id_not_empty CHECK (message_id <> ''),
    CONSTRAINT correlation_message_payload_json CHECK (json_valid(payload)),
    CONSTRAINT correlation_message_headers_object CHECK (json_valid(headers) AND json_type(headers) = 'object'),
    CONSTRAINT correlation_message_payload_at_most_1_mib CHECK (length(CAST(payload AS BLOB)) <= 1048576),
    CONSTRAINT correlation_message_headers_at_most_64_kib CHECK (length(CAST(headers AS BLOB)) <= 65536),
    CONSTRAINT correlation_message_ttl_not_negative CHECK (time_to_live >= 0),
    CONSTRAINT correlation_message_ttl_at_most_1000_years CHECK (time_to_live <= 31557600000),
    -- Times are compared as text, so only UTC 'YYYY-MM-DD HH:MM:SS[.ffffff]' is accepted.
    CONSTRAINT correlation_message_created_at_utc_text CHECK (
        julianday(created_at) IS NOT NULL
        AND created_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
        AND substr(created_at, 20, 1) IN ('', '.') AND substr(created_at, 21) NOT GLOB '*[^0-9]*'),
    CONSTRAINT correlation_message_created_at_after_year_1 CHECK (created_at >= '0001-01-02'),
    CONSTRAINT correlation_message_expires_at_utc_text CHECK (expires_at IS NULL OR (
        julianday(expires_at) IS NOT NULL
        AND expires_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
        AND substr(expires_at, 20, 1) IN ('', '.') AND substr(expires_at, 21) NOT GLOB '*[^0-9]*')),
    CONSTRAINT correlation_message_next_attempt_at_readable CHECK (next_attempt_at IS NULL OR (
        julianday(next_attempt_at) IS NOT NULL
        AND next_attempt_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
        AND substr(next_attempt_at, 20, 1) IN ('', '.') AND substr(next_attempt_at, 21) NOT GLOB '*[^0-9]*'
        AND next_attempt_at >= '0001-01-02' AND next_attempt_at < '9999-12-31')),
    CONSTRAINT correlation_message_expires_after_created CHECK (julianday(expires_at) >= julianday(created_at)),
    CONSTRAINT correlation_message_attempt_not_negative CHECK (attempt >= 0),
    CONSTRAINT correlation_message_attempt_at_most_a_billion CHECK (attempt <= 1000000000),
    CONSTRAINT correlation_message_reschedule_count_not_negative CHECK (reschedule_count >= 0),
    CONSTRAINT correlation_message_reschedule_count_at_most_a_billion CHECK (reschedule_count <= 1000000000),
    CONSTRAINT correlation_message_lost_calls_in_range CHECK (lost_calls BETWEEN 0 AND 1000000000),
    CONSTRAINT correlation_message_crashed_calls_in_range CHECK (crashed_calls BETWEEN 0 AND lost_calls),
    CONSTRAINT correlation_message_state_known CHECK (state IN ('ready', 'paused', 'dead'))
);

INSERT INTO correlation_message_v3 (
    id, message_id, message_name, correlation_hint, payload, headers, created_at, time_to_live, expires_at,
    attempt, next_attempt_at, reschedule_count, last_error, state, slot)
SELECT id, message_id, message_name, correlation_hint, payload, headers, created_at, time_to_live, expires_at,
       min(attempt, 1000000000),
       CASE WHEN next_attempt_at IS NULL OR (julianday(next_attempt_at) IS NOT NULL
                 AND next_attempt_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
                 AND next_attempt_at >= '0001-01-02' AND next_attempt_at < '9999-12-31')
            THEN next_attempt_at END,
       min(reschedule_count, 1000000000),
       CASE WHEN next_attempt_at IS NOT NULL AND NOT (julianday(next_attempt_at) IS NOT NULL
                 AND next_attempt_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
                 AND next_attempt_at >= '0001-01-02' AND next_attempt_at < '9999-12-31')
            THEN 'dead-lettered by the schema upgrade: next_attempt_at ' || next_attempt_at || ' cannot be read'
            ELSE last_error END,
       CASE WHEN next_attempt_at IS NOT NULL AND NOT (julianday(next_attempt_at) IS NOT NULL
                 AND next_attempt_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
                 AND next_attempt_at >= '0001-01-02' AND next_attempt_at < '9999-12-31')
            THEN 'dead' ELSE state END,
       slot
  FROM correlation_message;

-- The largest id handed out so far, also of rows already deleted, so that ids are never taken twice.
DELETE FROM sqlite_sequence WHERE name = 'correlation_message_v3';
INSERT INTO sqlite_sequence (name, seq)
SELECT 'correlation_message_v3', seq FROM sqlite_sequence WHERE name = 'correlation_message';
DROP TABLE correlation_message;
ALTER TABLE correlation_message_v3 RENAME TO correlation_message;

CREATE INDEX correlation_message_fresh_hint_idx ON correlation_message (slot, correlation_hint)
    WHERE state = 'ready' AND next_attempt_at IS NULL;
CREATE INDEX correlation_message_due_idx ON correlation_message (slot, next_attempt_at)
    WHERE state = 'ready' AND next_attempt_at IS NOT NULL;
CREATE INDEX correlation_message_hint_ready_idx ON correlation_message (correlation_hint, id)
    WHERE state = 'ready';
CREATE INDEX correlation_message_hint_delayed_idx ON correlation_message (correlation_hint, id)
    WHERE state = 'ready' AND next_attempt_at IS NOT NULL;
CREATE INDEX correlation_message_hint_held_idx ON correlation_message (correlation_hint, state, id)
    WHERE state <> 'ready';
CREATE INDEX correlation_message_pause_idx ON correlation_message (pause_id) WHERE pause_id IS NOT NULL;
CREATE INDEX correlation_message_expires_idx ON correlation_message (expires_at)
    WHERE expires_at IS NOT NULL;
CREATE INDEX correlation_message_name_state_idx ON correlation_message (message_name, state);

CREATE TABLE correlation_pause (
    id          INTEGER PRIMARY KEY AUTOINCREMENT,
    scope       TEXT NOT NULL,
    target      TEXT NOT NULL DEFAULT '',
    reason      TEXT NOT NULL DEFAULT '',
    created_by  TEXT NOT NULL DEFAULT 'sql',
    created_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now')),
    CONSTRAINT correlation_pause_scope_known CHECK (scope IN ('all', 'name', 'hint')),
    CONSTRAINT correlation_pause_target_matches_scope CHECK ((scope = 'all') = (target = '')),
    CONSTRAINT correlation_pause_target_length CHECK (length(target) <= 255),
    CONSTRAINT correlation_pause_reason_length CHECK (length(reason) <= 1000),
    CONSTRAINT correlation_pause_once UNIQUE (scope, target)
);

ALTER TABLE correlation_lock ADD COLUMN in_flight_version INTEGER NOT NULL DEFAULT 0;

INSERT INTO correlation_lock (name, lock_until, locked_at, locked_by, fence)
VALUES ('slot:0', strftime('%Y-%m-%d %H:%M:%f000', 'now'), strftime('%Y-%m-%d %H:%M:%f000', 'now'), '', 0)
    ON CONFLICT (name) DO NOTHING;
