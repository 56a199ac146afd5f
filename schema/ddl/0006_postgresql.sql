-- correlation-worker schema, revision 0006, PostgreSQL: what the planner assumes about hints.
--
-- A hint is an order, a customer, a process instance: a correlation table holds many of them, each with a few
-- messages. When one hint holds most of the rows (a stuck hint with a long backlog), ANALYZE counts only a
-- handful of distinct hints, the planner expects every hint to have thousands of messages, and it reads a
-- hint's first messages by walking the primary key through the big hint's rows instead of the (hint, id)
-- index: every fetch then costs the backlog. Fixing the estimate at about ten messages per hint keeps the
-- hint's own index range the cheapest path, whatever the table holds.
ALTER TABLE correlation_message ALTER COLUMN correlation_hint SET (n_distinct = -0.1);
