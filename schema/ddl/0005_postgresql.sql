-- correlation-worker schema, revision 0005, PostgreSQL: the console's audit trail, and indexes that keep the
-- console's filtered pages O(page) at millions of rows.

-- Every mutating action of an operator (console API, pages, CLI): who, what, which filter, how many, when.
-- Rows are only ever inserted; they are read newest first (keyset on id).
CREATE TABLE correlation_audit (
    -- Arrival order; the console pages through the audit by it, newest first.
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    -- When the action ended (the database clock).
    at        timestamptz NOT NULL DEFAULT now(),
    -- Who: the name of the token used (CORRELATION_ADMIN__TOKEN_NAME), never the token itself; 'cli:<user>'
    -- for the command line (the operating system user that ran it).
    actor     text NOT NULL,
    -- Through which face: 'api' (JSON API), 'ui' (the pages) or 'cli'.
    via       text NOT NULL,
    -- What: 'messages.requeue', 'messages.pause', 'messages.resume', 'messages.delete', 'pauses.add',
    -- 'pauses.remove', ...
    action    text NOT NULL,
    -- Which: the filter of a bulk action ({"name": ..., "state": ...}, {"ids": [...]}, {"all": true}) or the
    -- pause acted on, as JSON.
    target    jsonb NOT NULL DEFAULT '{}',
    -- How many rows the action changed.
    affected  bigint NOT NULL DEFAULT 0,
    -- Why the action stopped part way (a bulk action's chunk failed), or NULL when it completed.
    error     text,
    CONSTRAINT correlation_audit_via_known CHECK (via IN ('api', 'ui', 'cli')),
    CONSTRAINT correlation_audit_actor_length CHECK (length(actor) BETWEEN 1 AND 255),
    CONSTRAINT correlation_audit_action_length CHECK (length(action) BETWEEN 1 AND 100),
    CONSTRAINT correlation_audit_affected_not_negative CHECK (affected >= 0)
);

-- The console pages messages in id order under a filter. A name's messages (optionally of one state) are read
-- in id order from here: (message_name, state, id) replaces (message_name, state), which served the same
-- lookups without the order (a name's page had to sort all its rows).
DROP INDEX correlation_message_name_state_idx;
CREATE INDEX correlation_message_name_state_id_idx ON correlation_message (message_name, state, id);

-- Paused and dead messages in id order (dead letters, the paused list), without reading the ready rows.
-- Ready rows are not in it: producers' inserts and the engine's deletes never touch it.
CREATE INDEX correlation_message_held_state_idx ON correlation_message (state, id) WHERE state <> 'ready';
