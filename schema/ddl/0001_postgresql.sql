-- correlation-worker schema, revision 0001, PostgreSQL.
-- Producers INSERT into correlation_message; every column after `expires_at` belongs to the worker.

CREATE TABLE correlation_message (
    -- Arrival order: batches are correlated in id order.
    id                bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- Producer's idempotency key: INSERT ... ON CONFLICT (message_id) DO NOTHING makes a resend a no-op.
    message_id        text UNIQUE,
    -- What the message is: routes it to a correlator and a retry policy.
    message_name      text NOT NULL,
    -- The batch key (an order id, a business key): one hint's messages are correlated in order, one at a time.
    correlation_hint  text NOT NULL,
    payload           jsonb NOT NULL DEFAULT '{}'::jsonb,
    headers           jsonb NOT NULL DEFAULT '{}'::jsonb,
    -- Producer's time; the time-to-live counts from it.
    created_at        timestamptz NOT NULL DEFAULT now(),
    -- Failures inside created_at + time_to_live are not recorded (the target may not be ready yet).
    time_to_live      interval,
    -- After this the message is never correlated and cleanup removes it.
    expires_at        timestamptz,
    -- Worker-owned columns.
    attempt           integer NOT NULL DEFAULT 0,
    -- NULL: due on arrival. Set by the worker when a failure, reschedule or buffering delays the message.
    next_attempt_at   timestamptz,
    reschedule_count  integer NOT NULL DEFAULT 0,
    last_error        text,
    state             text NOT NULL DEFAULT 'ready',
    -- Slot of the hint: leases are taken per slot, so one replica owns a hint. 64 slots.
    slot              smallint NOT NULL GENERATED ALWAYS AS (((hashtext(correlation_hint) % 64) + 64) % 64) STORED,

    CONSTRAINT correlation_message_name_not_empty CHECK (message_name <> ''),
    CONSTRAINT correlation_message_name_length CHECK (length(message_name) <= 255),
    CONSTRAINT correlation_message_hint_not_empty CHECK (correlation_hint <> ''),
    CONSTRAINT correlation_message_hint_length CHECK (length(correlation_hint) <= 255),
    CONSTRAINT correlation_message_message_id_not_empty CHECK (message_id <> ''),
    CONSTRAINT correlation_message_ttl_not_negative CHECK (time_to_live >= interval '0'),
    CONSTRAINT correlation_message_ttl_at_most_1000_years CHECK (time_to_live <= interval '1000 years'),
    -- Finite and before the year 10000 (what clients can read); 'infinity' is refused: leave expires_at NULL
    -- for a message that never expires.
    CONSTRAINT correlation_message_created_at_readable
        CHECK (isfinite(created_at) AND created_at < '10000-01-01 00:00:00+00'),
    CONSTRAINT correlation_message_expires_at_readable
        CHECK (isfinite(expires_at) AND expires_at < '10000-01-01 00:00:00+00'),
    CONSTRAINT correlation_message_expires_after_created CHECK (expires_at >= created_at),
    CONSTRAINT correlation_message_headers_object CHECK (jsonb_typeof(headers) = 'object'),
    CONSTRAINT correlation_message_attempt_not_negative CHECK (attempt >= 0),
    CONSTRAINT correlation_message_reschedule_count_not_negative CHECK (reschedule_count >= 0),
    CONSTRAINT correlation_message_state_known CHECK (state IN ('ready', 'paused', 'dead'))
);

-- The poll: messages due on arrival, of given slots, in id order (keyset paging).
CREATE INDEX correlation_message_fresh_idx ON correlation_message (slot, id)
    WHERE state = 'ready' AND next_attempt_at IS NULL;
-- The poll: delayed messages whose due time has passed (waiting ones are never scanned).
CREATE INDEX correlation_message_due_idx ON correlation_message (slot, next_attempt_at)
    WHERE state = 'ready' AND next_attempt_at IS NOT NULL;
-- A hint's earlier messages that may hold it back (delayed, paused or dead ones).
CREATE INDEX correlation_message_blocking_idx ON correlation_message (correlation_hint, id)
    WHERE state <> 'ready' OR next_attempt_at IS NOT NULL;
-- Cleanup of expired messages.
CREATE INDEX correlation_message_expires_idx ON correlation_message (expires_at)
    WHERE expires_at IS NOT NULL;
-- Admin queries by name and state.
CREATE INDEX correlation_message_name_state_idx ON correlation_message (message_name, state);

-- ShedLock's shape plus a fence incremented on every acquisition. Times come from the database clock.
CREATE TABLE correlation_lock (
    name       varchar(64) PRIMARY KEY,
    lock_until timestamptz NOT NULL,
    locked_at  timestamptz NOT NULL,
    locked_by  varchar(255) NOT NULL,
    fence      bigint NOT NULL DEFAULT 0
);
