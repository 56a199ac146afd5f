-- correlation-worker schema, revision 0015, PostgreSQL: a message's hint stays as it is while it is being called.
--
-- A hint decides the slot, and the slot the replica that calls the hint's messages in order. A message whose hint
-- changed during its call would be called by its old slot's holder while the new hint's holder calls that hint's
-- other messages: two replicas on one hint. An UPDATE changing the hint of a message whose call is marked
-- (correlation_call) is refused with a check violation naming it; once the call ended it may change.
CREATE FUNCTION correlation_message_hint_kept() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM correlation_call WHERE message_id = OLD.id) THEN
        RAISE EXCEPTION 'correlation_message_hint_kept: message % is being called; its correlation_hint cannot change until the call ends (try again shortly)', OLD.id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'correlation_message_hint_kept',
                  TABLE = 'correlation_message';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER correlation_message_hint_kept BEFORE UPDATE OF correlation_hint ON correlation_message
    FOR EACH ROW WHEN (OLD.correlation_hint IS DISTINCT FROM NEW.correlation_hint)
    EXECUTE FUNCTION correlation_message_hint_kept();
