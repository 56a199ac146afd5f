-- correlation-worker schema, revision 0011, PostgreSQL: a delivery record's name and hint are not checked again.
--
-- PostgreSQL evaluates every CHECK constraint of a row at each UPDATE, whatever columns it sets. The four rules
-- of revision 0008 on the message name and the correlation hint are regular expressions, and a message that
-- becomes its delivery record (revision 0010) is updated once more: those four took about a seventh of that
-- update's time, for columns it never sets. A record's name and hint were checked when it was inserted as a
-- message, and nothing calls a record: each rule now lets a 'delivered' row through. A row inserted as
-- 'delivered' is still held to them, by the trigger that runs for rows inserted in another state than 'ready'
-- (under the same constraint names), and a message going back to 'ready' or any other live state is held to
-- them by the constraints themselves. NOT VALID as in 0008: rows made dead by that revision stay as they are.
ALTER TABLE correlation_message
    DROP CONSTRAINT correlation_message_name_no_blank_at_either_end,
    DROP CONSTRAINT correlation_message_name_printable,
    DROP CONSTRAINT correlation_message_hint_not_blank,
    DROP CONSTRAINT correlation_message_hint_printable,
    ADD CONSTRAINT correlation_message_name_no_blank_at_either_end
        CHECK (state = 'delivered' OR message_name !~ '^\s|\s$') NOT VALID,
    ADD CONSTRAINT correlation_message_name_printable
        CHECK (state = 'delivered'
               OR message_name !~ '[[:cntrl:]\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]') NOT VALID,
    ADD CONSTRAINT correlation_message_hint_not_blank
        CHECK (state = 'delivered' OR correlation_hint = '' OR correlation_hint ~ '\S') NOT VALID,
    ADD CONSTRAINT correlation_message_hint_printable
        CHECK (state = 'delivered'
               OR correlation_hint !~ '[[:cntrl:]\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]') NOT VALID;

-- Revision 0008's trigger for rows inserted in another state than 'ready', with the four rules for a row
-- inserted as 'delivered' (raised as the constraints raise them: check_violation, under the rule's name).
CREATE OR REPLACE FUNCTION correlation_message_inserted_state() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    bad constant text := '[[:cntrl:]\u00ad\u061c\u180e\u200b-\u200f\u2028-\u202e\u2060-\u206f\ufeff]';
    broken text;
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
    IF NEW.state = 'delivered' THEN
        broken := CASE
            WHEN NEW.message_name ~ '^\s|\s$' THEN 'correlation_message_name_no_blank_at_either_end'
            WHEN NEW.message_name ~ bad THEN 'correlation_message_name_printable'
            WHEN NEW.correlation_hint <> '' AND NEW.correlation_hint !~ '\S' THEN 'correlation_message_hint_not_blank'
            WHEN NEW.correlation_hint ~ bad THEN 'correlation_message_hint_printable' END;
        IF broken IS NOT NULL THEN
            RAISE EXCEPTION 'new row for relation "correlation_message" violates check constraint "%"', broken
                USING ERRCODE = 'check_violation', CONSTRAINT = broken, TABLE = 'correlation_message';
        END IF;
    END IF;
    RETURN NEW;
END
$$;
