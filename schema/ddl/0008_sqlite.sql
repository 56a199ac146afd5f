-- correlation-worker schema, revision 0008, SQLite: names that read as they match (see the PostgreSQL file
-- for why). SQLite cannot add a CHECK constraint to a table: each rule is a pair of triggers (an insert, an
-- update of its column) refusing a row under the rule's name. Messages already in the file that break a rule
-- are made dead first, with the rule in last_error (as on PostgreSQL).

UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0008: a message name has no blank at either end'
 WHERE state <> 'dead' AND (message_name <> trim(message_name, ' ' || char(9) || char(10) || char(11) || char(12) || char(13)));
UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0008: a message name holds no control or invisible formatting character'
 WHERE state <> 'dead' AND (message_name GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*');
UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0008: a correlation hint is more than blanks'
 WHERE state <> 'dead' AND (correlation_hint <> '' AND trim(correlation_hint, ' ' || char(9) || char(10) || char(11) || char(12) || char(13)) = '');
UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0008: a correlation hint holds no control or invisible formatting character'
 WHERE state <> 'dead' AND (correlation_hint GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*');
UPDATE correlation_message SET state = 'dead', next_attempt_at = NULL,
       last_error = 'schema revision 0008: a message_id has at most 1000 bytes'
 WHERE state <> 'dead' AND (length(CAST(message_id AS BLOB)) > 1000);

CREATE TRIGGER correlation_message_name_no_blank_at_either_end_insert BEFORE INSERT ON correlation_message
    WHEN NEW.message_name <> trim(NEW.message_name, ' ' || char(9) || char(10) || char(11) || char(12) || char(13))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_name_no_blank_at_either_end: a message name has no blank at either end');
END;
CREATE TRIGGER correlation_message_name_no_blank_at_either_end_update BEFORE UPDATE OF message_name ON correlation_message
    WHEN NEW.message_name <> trim(NEW.message_name, ' ' || char(9) || char(10) || char(11) || char(12) || char(13))
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_name_no_blank_at_either_end: a message name has no blank at either end');
END;
CREATE TRIGGER correlation_message_name_printable_insert BEFORE INSERT ON correlation_message
    WHEN NEW.message_name GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*'
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_name_printable: a message name holds no control or invisible formatting character');
END;
CREATE TRIGGER correlation_message_name_printable_update BEFORE UPDATE OF message_name ON correlation_message
    WHEN NEW.message_name GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*'
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_name_printable: a message name holds no control or invisible formatting character');
END;
CREATE TRIGGER correlation_message_hint_not_blank_insert BEFORE INSERT ON correlation_message
    WHEN NEW.correlation_hint <> '' AND trim(NEW.correlation_hint, ' ' || char(9) || char(10) || char(11) || char(12) || char(13)) = ''
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_hint_not_blank: a correlation hint is more than blanks');
END;
CREATE TRIGGER correlation_message_hint_not_blank_update BEFORE UPDATE OF correlation_hint ON correlation_message
    WHEN NEW.correlation_hint <> '' AND trim(NEW.correlation_hint, ' ' || char(9) || char(10) || char(11) || char(12) || char(13)) = ''
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_hint_not_blank: a correlation hint is more than blanks');
END;
CREATE TRIGGER correlation_message_hint_printable_insert BEFORE INSERT ON correlation_message
    WHEN NEW.correlation_hint GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*'
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_hint_printable: a correlation hint holds no control or invisible formatting character');
END;
CREATE TRIGGER correlation_message_hint_printable_update BEFORE UPDATE OF correlation_hint ON correlation_message
    WHEN NEW.correlation_hint GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*'
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_hint_printable: a correlation hint holds no control or invisible formatting character');
END;
CREATE TRIGGER correlation_message_message_id_at_most_1000_bytes_insert BEFORE INSERT ON correlation_message
    WHEN length(CAST(NEW.message_id AS BLOB)) > 1000
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_message_id_at_most_1000_bytes: a message_id has at most 1000 bytes');
END;
CREATE TRIGGER correlation_message_message_id_at_most_1000_bytes_update BEFORE UPDATE OF message_id ON correlation_message
    WHEN length(CAST(NEW.message_id AS BLOB)) > 1000
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_message_id_at_most_1000_bytes: a message_id has at most 1000 bytes');
END;
CREATE TRIGGER correlation_schedule_name_no_blank_at_either_end_insert BEFORE INSERT ON correlation_schedule
    WHEN NEW.name <> '' AND (trim(NEW.name, ' ' || char(9) || char(10) || char(11) || char(12) || char(13)) = '' OR NEW.name <> trim(NEW.name, ' ' || char(9) || char(10) || char(11) || char(12) || char(13)))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_name_no_blank_at_either_end: a schedule name is more than blanks and has no blank at either end');
END;
CREATE TRIGGER correlation_schedule_name_no_blank_at_either_end_update BEFORE UPDATE OF name ON correlation_schedule
    WHEN NEW.name <> '' AND (trim(NEW.name, ' ' || char(9) || char(10) || char(11) || char(12) || char(13)) = '' OR NEW.name <> trim(NEW.name, ' ' || char(9) || char(10) || char(11) || char(12) || char(13)))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_name_no_blank_at_either_end: a schedule name is more than blanks and has no blank at either end');
END;
CREATE TRIGGER correlation_schedule_name_printable_insert BEFORE INSERT ON correlation_schedule
    WHEN NEW.name GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*'
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_name_printable: a schedule name holds no control or invisible formatting character');
END;
CREATE TRIGGER correlation_schedule_name_printable_update BEFORE UPDATE OF name ON correlation_schedule
    WHEN NEW.name GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*'
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_name_printable: a schedule name holds no control or invisible formatting character');
END;
CREATE TRIGGER correlation_schedule_message_name_no_blank_at_either_end_insert BEFORE INSERT ON correlation_schedule
    WHEN NEW.message_name <> trim(NEW.message_name, ' ' || char(9) || char(10) || char(11) || char(12) || char(13))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_message_name_no_blank_at_either_end: a message name has no blank at either end');
END;
CREATE TRIGGER correlation_schedule_message_name_no_blank_at_either_end_update BEFORE UPDATE OF message_name ON correlation_schedule
    WHEN NEW.message_name <> trim(NEW.message_name, ' ' || char(9) || char(10) || char(11) || char(12) || char(13))
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_message_name_no_blank_at_either_end: a message name has no blank at either end');
END;
CREATE TRIGGER correlation_schedule_message_name_printable_insert BEFORE INSERT ON correlation_schedule
    WHEN NEW.message_name GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*'
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_message_name_printable: a message name holds no control or invisible formatting character');
END;
CREATE TRIGGER correlation_schedule_message_name_printable_update BEFORE UPDATE OF message_name ON correlation_schedule
    WHEN NEW.message_name GLOB '*[' || char(1) || '-' || char(31) || char(127) || '-' || char(159) || char(173) || char(1564) || char(6158) || char(8203) || '-' || char(8207) || char(8232) || '-' || char(8238) || char(8288) || '-' || char(8303) || char(65279) || ']*'
BEGIN
    SELECT RAISE(ABORT, 'correlation_schedule_message_name_printable: a message name holds no control or invisible formatting character');
END;

-- States a producer's INSERT may give beside 'ready': 'paused' only under a durable pause that exists (or none),
-- 'dead' only with a reason, which the schema writes when none is given (see the PostgreSQL file).
CREATE TRIGGER correlation_message_pause_exists BEFORE INSERT ON correlation_message
    WHEN NEW.state = 'paused' AND NEW.pause_id IS NOT NULL
         AND NOT EXISTS (SELECT 1 FROM correlation_pause WHERE id = NEW.pause_id)
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_pause_exists: a message inserted paused names a durable pause that does not exist (lifting it would never resume the message); leave pause_id out or insert it ready');
END;
CREATE TRIGGER correlation_message_dead_has_a_reason AFTER INSERT ON correlation_message
    WHEN NEW.state = 'dead' AND NEW.last_error IS NULL
BEGIN
    UPDATE correlation_message SET last_error = 'inserted as dead, not by the worker: it was never called'
     WHERE id = NEW.id;
END;
