-- correlation-worker schema, revision 0004, PostgreSQL: schedules (DESIGN.md §7).
-- Operators INSERT, UPDATE and DELETE schedules with plain SQL, like messages; replicas notice the change within
-- CORRELATION_SCHEDULER__RELOAD_INTERVAL. Every column after `headers` belongs to the worker.

CREATE TABLE correlation_schedule (
    -- The schedule's identity; also the default correlation hint and the label of its metrics.
    name               text PRIMARY KEY,
    -- A Quartz cron expression, seconds first, 6 or 7 fields ('0 0/15 8-18 ? * MON-FRI'). The schema cannot judge
    -- it: a replica that finds it invalid records why in invalid_reason and never fires the schedule.
    cron               text NOT NULL,
    -- The IANA time zone the expression's wall-clock times are read in ('Europe/Berlin').
    time_zone          text NOT NULL DEFAULT 'UTC',
    -- A disabled schedule publishes nothing, and its missed times are not caught up when it is enabled again.
    enabled            boolean NOT NULL DEFAULT true,
    -- A fire time is skipped while the schedule's last message is still in correlation_message and not dead.
    singleton          boolean NOT NULL DEFAULT true,
    -- What happens to fire times missed while no replica ran: fire_once_now, do_nothing or fire_all.
    misfire            text NOT NULL DEFAULT 'fire_once_now',
    -- What each fire publishes into correlation_message: its message_name, correlation_hint (NULL: the schedule's
    -- name), payload, and headers (the scheduler adds schedule, fire_time, job_number, action and action_type).
    message_name       text NOT NULL,
    correlation_hint   text,
    payload            jsonb NOT NULL DEFAULT '{}'::jsonb,
    headers            jsonb NOT NULL DEFAULT '{}'::jsonb,
    created_at         timestamptz NOT NULL DEFAULT now(),
    -- Worker-owned columns.
    -- The next fire time (by the database clock, compared with now() to decide it is due). NULL while the schedule
    -- is disabled, invalid, not planned yet, or has no fire time left. Replicas advance it with a compare-and-set
    -- in the transaction that inserts the message: one message per fire time, whatever the number of replicas.
    next_fire_at       timestamptz,
    -- The cron and time_zone next_fire_at was computed from: when an UPDATE changes them, it is computed again.
    planned_cron       text,
    planned_time_zone  text,
    -- The fire time of the last published message (the scheduled time, or when it was fired by hand) and its kind.
    last_fire_at       timestamptz,
    last_fire_kind     text,
    -- message_id of the last published message: singleton, "running" and its last error are read through it.
    last_message_id    text,
    -- Messages published (the job_number of the last one), fire times skipped because the last message was still
    -- pending (singleton), and fire times skipped by the misfire policy.
    fire_count         bigint NOT NULL DEFAULT 0,
    skip_count         bigint NOT NULL DEFAULT 0,
    last_skipped_at    timestamptz,
    misfire_count      bigint NOT NULL DEFAULT 0,
    -- Why the schedule cannot fire (an invalid cron expression or time zone), as a replica found it; else NULL.
    invalid_reason     text,

    CONSTRAINT correlation_schedule_name_not_empty CHECK (name <> ''),
    CONSTRAINT correlation_schedule_name_length CHECK (length(name) <= 255),
    CONSTRAINT correlation_schedule_cron_not_empty CHECK (btrim(cron) <> ''),
    CONSTRAINT correlation_schedule_cron_length CHECK (length(cron) <= 1000),
    CONSTRAINT correlation_schedule_time_zone_not_empty CHECK (time_zone <> ''),
    CONSTRAINT correlation_schedule_misfire_known CHECK (misfire IN ('fire_once_now', 'do_nothing', 'fire_all')),
    CONSTRAINT correlation_schedule_message_name_not_empty CHECK (message_name <> ''),
    CONSTRAINT correlation_schedule_message_name_length CHECK (length(message_name) <= 255),
    CONSTRAINT correlation_schedule_hint_not_empty CHECK (correlation_hint <> ''),
    CONSTRAINT correlation_schedule_hint_length CHECK (length(correlation_hint) <= 255),
    CONSTRAINT correlation_schedule_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    CONSTRAINT correlation_schedule_last_fire_kind_known CHECK (last_fire_kind IN ('scheduled', 'manual')),
    CONSTRAINT correlation_schedule_counts_not_negative
        CHECK (fire_count >= 0 AND skip_count >= 0 AND misfire_count >= 0)
);

-- The switch of the whole scheduler (seed 004's global `enabled`): one row. While it is off no schedule publishes,
-- and times that pass are not caught up when it is switched on again.
CREATE TABLE correlation_scheduler (
    id          smallint PRIMARY KEY DEFAULT 1,
    enabled     boolean NOT NULL DEFAULT true,
    changed_at  timestamptz NOT NULL DEFAULT now(),

    CONSTRAINT correlation_scheduler_one_row CHECK (id = 1)
);
INSERT INTO correlation_scheduler (id, enabled) VALUES (1, true);
