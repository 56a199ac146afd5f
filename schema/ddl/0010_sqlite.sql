-- correlation-worker schema, revision 0010, SQLite: the delivery record and the deduplication window (see the
-- PostgreSQL file). The state rule's CHECK constraint gains 'delivered' in the migration's own code (SQLite
-- cannot alter a constraint); the record's two other rules are triggers, as in revision 0008.
ALTER TABLE correlation_message ADD COLUMN outcome TEXT;
ALTER TABLE correlation_message ADD COLUMN result TEXT;
ALTER TABLE correlation_message ADD COLUMN finished_at TEXT;
ALTER TABLE correlation_message ADD COLUMN finished_by TEXT;

CREATE TRIGGER correlation_message_record_complete_insert BEFORE INSERT ON correlation_message
    WHEN (NEW.state = 'delivered') <> (NEW.outcome IS NOT NULL AND NEW.finished_at IS NOT NULL)
         OR NEW.outcome NOT IN ('correlated', 'expired', 'deleted')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_record_complete: a record has its outcome and finished_at, a live message neither');
END;
CREATE TRIGGER correlation_message_record_complete_update BEFORE UPDATE OF state, outcome, finished_at ON correlation_message
    WHEN (NEW.state = 'delivered') <> (NEW.outcome IS NOT NULL AND NEW.finished_at IS NOT NULL)
         OR NEW.outcome NOT IN ('correlated', 'expired', 'deleted')
BEGIN
    SELECT RAISE(ABORT, 'correlation_message_record_complete: a record has its outcome and finished_at, a live message neither');
END;

CREATE INDEX correlation_message_finished_idx ON correlation_message (finished_at, id) WHERE state = 'delivered';
