-- correlation-worker schema, revision 0015, SQLite: a message's hint stays as it is while it is being called (see
-- the PostgreSQL revision for why).
CREATE TRIGGER correlation_message_hint_kept BEFORE UPDATE OF correlation_hint ON correlation_message
    WHEN OLD.correlation_hint IS NOT NEW.correlation_hint
     AND EXISTS (SELECT 1 FROM correlation_call WHERE message_id = OLD.id)
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_hint_kept: the message is being called; its correlation_hint cannot change until the call ends (try again shortly)');
END;
