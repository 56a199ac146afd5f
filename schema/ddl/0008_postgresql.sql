-- correlation-worker schema, revision 0008, PostgreSQL: names that read as they match.
--
-- A message name picks the message's route by exact match, and names and hints are shown in logs, metrics and
-- the console. A name with a blank at either end ('order.paid ') silently falls to the "*" route; a hint of
-- blanks is no conversation; control characters and invisible formatting characters (U+200B zero width space,
-- U+202E right-to-left override, ...) make a value print as something it is not. The rules below refuse such
-- values where producers write them, with plain SQL, each under a name that says the rule.
--
-- Messages already in the table that break a rule are made dead first, with the rule in last_error, so that the
-- upgrade never fails on them and no call goes to the wrong route; an operator deletes them (or fixes the name
-- and requeues them: an update must satisfy the rules). The constraints are NOT VALID for that reason only.
UPDATE correlation_message
   SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0008: ' || CASE
           WHEN message_name ~ '^\s|\s$' THEN 'the message name has a blank at either end'
           WHEN message_name ~ '[[:cntrl:]\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]'
               THEN 'the message name holds a control or invisible formatting character'
           WHEN correlation_hint <> '' AND correlation_hint !~ '\S' THEN 'the correlation hint is only blanks'
           WHEN octet_length(message_id) > 1000 THEN 'the message_id is longer than 1000 bytes'
           ELSE 'the correlation hint holds a control or invisible formatting character' END
 WHERE state <> 'dead'
   AND (message_name ~ '^\s|\s$'
        OR message_name ~ '[[:cntrl:]\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]'
        OR (correlation_hint <> '' AND correlation_hint !~ '\S')
        OR correlation_hint ~ '[[:cntrl:]\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]'
        OR octet_length(message_id) > 1000);

-- A name: no blank at either end, no control or invisible formatting character. A hint: more than blanks, no
-- control or invisible formatting character (blanks inside either are their own business).
ALTER TABLE correlation_message
    ADD CONSTRAINT correlation_message_name_no_blank_at_either_end
        CHECK (message_name !~ '^\s|\s$') NOT VALID,
    ADD CONSTRAINT correlation_message_name_printable
        CHECK (message_name !~ '[[:cntrl:]\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]') NOT VALID,
    ADD CONSTRAINT correlation_message_hint_not_blank
        CHECK (correlation_hint = '' OR correlation_hint ~ '\S') NOT VALID,
    ADD CONSTRAINT correlation_message_hint_printable
        CHECK (correlation_hint !~ '[[:cntrl:]\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]') NOT VALID,
    -- The unique index on message_id holds at most about 2 700 bytes per entry: a longer id would fail there,
    -- with an index error, instead of under this rule's name.
    ADD CONSTRAINT correlation_message_message_id_at_most_1000_bytes
        CHECK (octet_length(message_id) <= 1000) NOT VALID;

-- Schedules: the same rules for a schedule's name (also more than blanks) and its message name. A trigger on the
-- named columns, not a CHECK, so that the scheduler's own updates of a row written before this revision (its next
-- fire time, its invalid_reason) still go through.
CREATE FUNCTION correlation_schedule_names_check() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad constant text := '[[:cntrl:]\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]';
BEGIN
    IF NEW.name <> '' AND (NEW.name !~ '\S' OR NEW.name ~ '^\s|\s$') THEN  -- '' is name_not_empty's
        RAISE EXCEPTION 'correlation_schedule_name_no_blank_at_either_end: a schedule name is more than blanks and has no blank at either end: %', quote_literal(NEW.name)
            USING ERRCODE = 'check_violation', CONSTRAINT = 'correlation_schedule_name_no_blank_at_either_end',
                  TABLE = 'correlation_schedule';
    ELSIF NEW.name ~ bad THEN
        RAISE EXCEPTION 'correlation_schedule_name_printable: a schedule name holds no control or invisible formatting character'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'correlation_schedule_name_printable',
                  TABLE = 'correlation_schedule';
    ELSIF NEW.message_name ~ '^\s|\s$' THEN
        RAISE EXCEPTION 'correlation_schedule_message_name_no_blank_at_either_end: a message name has no blank at either end: %', quote_literal(NEW.message_name)
            USING ERRCODE = 'check_violation', CONSTRAINT = 'correlation_schedule_message_name_no_blank_at_either_end',
                  TABLE = 'correlation_schedule';
    ELSIF NEW.message_name ~ bad THEN
        RAISE EXCEPTION 'correlation_schedule_message_name_printable: a message name holds no control or invisible formatting character'
            USING ERRCODE = 'check_violation', CONSTRAINT = 'correlation_schedule_message_name_printable',
                  TABLE = 'correlation_schedule';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER correlation_schedule_names BEFORE INSERT OR UPDATE OF name, message_name ON correlation_schedule
    FOR EACH ROW EXECUTE FUNCTION correlation_schedule_names_check();

-- States a producer's INSERT may give a message beside 'ready' (which is what producers own): 'paused' only under a
-- durable pause that exists (or none: paused until resumed by hand), and 'dead' only with a reason, which the
-- schema writes when none is given. The trigger runs only for rows inserted in another state than 'ready', so a
-- producer's ordinary insert pays nothing for it.
CREATE FUNCTION correlation_message_inserted_state() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'paused' AND NEW.pause_id IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM correlation_pause WHERE id = NEW.pause_id) THEN
        RAISE EXCEPTION 'correlation_message_pause_exists: a message inserted paused names durable pause %, which does not exist (lifting it would never resume the message); leave pause_id out or insert it ready', NEW.pause_id
            USING ERRCODE = 'check_violation', CONSTRAINT = 'correlation_message_pause_exists',
                  TABLE = 'correlation_message';
    END IF;
    IF NEW.state = 'dead' AND NEW.last_error IS NULL THEN
        NEW.last_error := 'inserted as dead, not by the worker: it was never called';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER correlation_message_inserted_state BEFORE INSERT ON correlation_message
    FOR EACH ROW WHEN (NEW.state <> 'ready') EXECUTE FUNCTION correlation_message_inserted_state();
