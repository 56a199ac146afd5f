-- correlation-worker schema, revision 0002.
-- The ids (a JSON array) of the messages a slot's holder handed to a correlator and has not recorded yet.
-- Cleared by every commit of results; a replica taking the slot over after a crash reads it to count
-- redeliveries.
ALTER TABLE correlation_lock ADD COLUMN in_flight text;
