-- correlation-worker schema, revision 0004, SQLite: schedules (DESIGN.md §7).
-- Same columns as PostgreSQL (see 0004_postgresql.sql for what each means); booleans are 0/1, times are UTC text
-- 'YYYY-MM-DD HH:MM:SS.ffffff', JSON is text.

CREATE TABLE correlation_schedule (
    name               TEXT PRIMARY KEY,
    cron               TEXT NOT NULL,
    time_zone          TEXT NOT NULL DEFAULT 'UTC',
    enabled            INTEGER NOT NULL DEFAULT 1,
    singleton          INTEGER NOT NULL DEFAULT 1,
    misfire            TEXT NOT NULL DEFAULT 'fire_once_now',
    message_name       TEXT NOT NULL,
    correlation_hint   TEXT,
    payload            TEXT NOT NULL DEFAULT '{}',
    headers            TEXT NOT NULL DEFAULT '{}',
    created_at         TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now')),
    next_fire_at       TEXT,
    planned_cron       TEXT,
    planned_time_zone  TEXT,
    last_fire_at       TEXT,
    last_fire_kind     TEXT,
    last_message_id    TEXT,
    fire_count         INTEGER NOT NULL DEFAULT 0,
    skip_count         INTEGER NOT NULL DEFAULT 0,
    last_skipped_at    TEXT,
    misfire_count      INTEGER NOT NULL DEFAULT 0,
    invalid_reason     TEXT,

    CONSTRAINT correlation_schedule_name_not_empty CHECK (name <> ''),
    CONSTRAINT correlation_schedule_name_length CHECK (length(name) <= 255),
    CONSTRAINT correlation_schedule_cron_not_empty CHECK (trim(cron) <> ''),
    CONSTRAINT correlation_schedule_cron_length CHECK (length(cron) <= 1000),
    CONSTRAINT correlation_schedule_time_zone_not_empty CHECK (time_zone <> ''),
    CONSTRAINT correlation_schedule_enabled_boolean CHECK (enabled IN (0, 1)),
    CONSTRAINT correlation_schedule_singleton_boolean CHECK (singleton IN (0, 1)),
    CONSTRAINT correlation_schedule_misfire_known CHECK (misfire IN ('fire_once_now', 'do_nothing', 'fire_all')),
    CONSTRAINT correlation_schedule_message_name_not_empty CHECK (message_name <> ''),
    CONSTRAINT correlation_schedule_message_name_length CHECK (length(message_name) <= 255),
    CONSTRAINT correlation_schedule_hint_not_empty CHECK (correlation_hint <> ''),
    CONSTRAINT correlation_schedule_hint_length CHECK (length(correlation_hint) <= 255),
    CONSTRAINT correlation_schedule_payload_json CHECK (json_valid(payload)),
    CONSTRAINT correlation_schedule_headers_object CHECK (json_valid(headers) AND json_type(headers) = 'object'),
    CONSTRAINT correlation_schedule_last_fire_kind_known CHECK (last_fire_kind IN ('scheduled', 'manual')),
    CONSTRAINT correlation_schedule_counts_not_negative
        CHECK (fire_count >= 0 AND skip_count >= 0 AND misfire_count >= 0)
);

CREATE TABLE correlation_scheduler (
    id          INTEGER PRIMARY KEY DEFAULT 1,
    enabled     INTEGER NOT NULL DEFAULT 1,
    changed_at  TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now')),

    CONSTRAINT correlation_scheduler_one_row CHECK (id = 1),
    CONSTRAINT correlation_scheduler_enabled_boolean CHECK (enabled IN (0, 1))
);
INSERT INTO correlation_scheduler (id, enabled) VALUES (1, 1);
