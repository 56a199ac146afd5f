-- correlation-worker schema, revision 0001, SQLite (the embedded single-replica default).
-- Same columns as PostgreSQL; times are UTC text 'YYYY-MM-DD HH:MM:SS.ffffff', time_to_live is seconds,
-- one replica owns every slot (slot is 0).

CREATE TABLE correlation_message (
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

    CONSTRAINT correlation_message_name_not_empty CHECK (message_name <> ''),
    CONSTRAINT correlation_message_name_length CHECK (length(message_name) <= 255),
    CONSTRAINT correlation_message_hint_not_empty CHECK (correlation_hint <> ''),
    CONSTRAINT correlation_message_hint_length CHECK (length(correlation_hint) <= 255),
    CONSTRAINT correlation_message_message_id_not_empty CHECK (message_id <> ''),
    CONSTRAINT correlation_message_payload_json CHECK (json_valid(payload)),
    CONSTRAINT correlation_message_headers_object CHECK (json_valid(headers) AND json_type(headers) = 'object'),
    CONSTRAINT correlation_message_ttl_not_negative CHECK (time_to_live >= 0),
    CONSTRAINT correlation_message_ttl_at_most_1000_years CHECK (time_to_live <= 31557600000),
    -- Times are compared as text, so only UTC 'YYYY-MM-DD HH:MM:SS[.ffffff]' is accepted.
    CONSTRAINT correlation_message_created_at_utc_text CHECK (
        julianday(created_at) IS NOT NULL
        AND created_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
        AND substr(created_at, 20, 1) IN ('', '.') AND substr(created_at, 21) NOT GLOB '*[^0-9]*'),
    CONSTRAINT correlation_message_expires_at_utc_text CHECK (expires_at IS NULL OR (
        julianday(expires_at) IS NOT NULL
        AND expires_at GLOB '[0-9][0-9][0-9][0-9]-[0-9][0-9]-[0-9][0-9] [0-9][0-9]:[0-9][0-9]:[0-9][0-9]*'
        AND substr(expires_at, 20, 1) IN ('', '.') AND substr(expires_at, 21) NOT GLOB '*[^0-9]*')),
    CONSTRAINT correlation_message_expires_after_created CHECK (julianday(expires_at) >= julianday(created_at)),
    CONSTRAINT correlation_message_attempt_not_negative CHECK (attempt >= 0),
    CONSTRAINT correlation_message_reschedule_count_not_negative CHECK (reschedule_count >= 0),
    CONSTRAINT correlation_message_state_known CHECK (state IN ('ready', 'paused', 'dead'))
);

CREATE INDEX correlation_message_fresh_idx ON correlation_message (slot, id)
    WHERE state = 'ready' AND next_attempt_at IS NULL;
CREATE INDEX correlation_message_due_idx ON correlation_message (slot, next_attempt_at)
    WHERE state = 'ready' AND next_attempt_at IS NOT NULL;
CREATE INDEX correlation_message_blocking_idx ON correlation_message (correlation_hint, id)
    WHERE state <> 'ready' OR next_attempt_at IS NOT NULL;
CREATE INDEX correlation_message_expires_idx ON correlation_message (expires_at)
    WHERE expires_at IS NOT NULL;
CREATE INDEX correlation_message_name_state_idx ON correlation_message (message_name, state);

CREATE TABLE correlation_lock (
    name       TEXT PRIMARY KEY CHECK (length(name) <= 64),
    lock_until TEXT NOT NULL,
    locked_at  TEXT NOT NULL,
    locked_by  TEXT NOT NULL,
    fence      INTEGER NOT NULL DEFAULT 0
);
