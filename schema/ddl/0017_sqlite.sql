-- correlation-worker schema, revision 0017, SQLite: what each replica routes and the settings it runs with (see
-- the PostgreSQL revision for what the columns hold).
CREATE TABLE correlation_replica (
    replica  TEXT PRIMARY KEY,
    routes   TEXT NOT NULL,
    settings TEXT NOT NULL,
    seen_at  TEXT NOT NULL
);
