-- correlation-worker schema, revision 0005, SQLite: the same audit table and indexes as on PostgreSQL (see
-- 0005_postgresql.sql for what each column means).

CREATE TABLE correlation_audit (
    id        INTEGER PRIMARY KEY AUTOINCREMENT,
    at        TEXT NOT NULL DEFAULT (strftime('%Y-%m-%d %H:%M:%f000', 'now')),
    actor     TEXT NOT NULL,
    via       TEXT NOT NULL,
    action    TEXT NOT NULL,
    target    TEXT NOT NULL DEFAULT '{}',
    affected  INTEGER NOT NULL DEFAULT 0,
    error     TEXT,
    CONSTRAINT correlation_audit_via_known CHECK (via IN ('api', 'ui', 'cli')),
    CONSTRAINT correlation_audit_actor_length CHECK (length(actor) BETWEEN 1 AND 255),
    CONSTRAINT correlation_audit_action_length CHECK (length(action) BETWEEN 1 AND 100),
    CONSTRAINT correlation_audit_target_json CHECK (json_valid(target)),
    CONSTRAINT correlation_audit_affected_not_negative CHECK (affected >= 0)
);

DROP INDEX correlation_message_name_state_idx;
CREATE INDEX correlation_message_name_state_id_idx ON correlation_message (message_name, state, id);
CREATE INDEX correlation_message_held_state_idx ON correlation_message (state, id) WHERE state <> 'ready';
