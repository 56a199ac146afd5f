-- correlation-worker schema, revision 0013, PostgreSQL: the console's indexes of live messages are out of the
-- engine's reach.
--
-- Two indexes serve only the console: a name's live messages by state in id order, and the paused and dead
-- messages in id order. Each was partial on the state ("not delivered"; "paused or dead"), and every statement
-- of the engine says which state it reads ("ready", "paused"), which proves those predicates: the planner could
-- choose either index for the engine's probes by hint or by id, reading it whole with a filter. It did whenever
-- the statistics said those indexes were empty, which is what autovacuum finds between two bursts: a table of
-- delivery records only (the default retention), or an empty one. The next burst then drained at a few hundred
-- messages a second instead of tens of thousands, every probe of a fetch and every lock of a group commit
-- reading all the live rows, until autovacuum looked at the table again.
--
-- A live message is one without an end: finished_at IS NULL exactly when the state is not 'delivered' (the
-- constraint correlation_message_record_complete of revision 0010). Both indexes are now partial on that column,
-- which the engine's statements never name, and the console's reads of live messages name it.
DROP INDEX correlation_message_name_state_id_idx;
CREATE INDEX correlation_message_name_state_id_idx ON correlation_message (message_name, state, id)
    WHERE finished_at IS NULL;
DROP INDEX correlation_message_held_state_idx;
CREATE INDEX correlation_message_held_state_idx ON correlation_message (state, id)
    WHERE state IN ('paused', 'dead') AND finished_at IS NULL;
