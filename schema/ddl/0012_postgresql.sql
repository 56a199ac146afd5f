-- correlation-worker schema, revision 0012, PostgreSQL: a gate that says at once whether any producer
-- transaction is registered, so that the commit-order horizon reads the server's locks only when one is.
--
-- Revision 0003's horizon read every lock the server held (pg_locks) at every fetch: a quarter of a millisecond
-- on an idle server, more with several replicas, and it takes each lock partition in turn, under the producers'
-- own lock traffic. Now every producer transaction also holds one common key, the gate, shared, taken before it
-- reads the sequence (so before it takes any id) and held until it ends, as its registration is. The horizon
-- reads the sequence, then tries the gate exclusively, without waiting: when it gets it, no producer transaction
-- is registered, every id up to the sequence's last value belongs to a finished transaction, and there is no
-- lock to read. It lets the gate go at once (the try runs in a block of its own that is rolled back, so the gate
-- is never kept, whatever interrupts it). A producer that registers in that moment waits for it, a few
-- microseconds; nothing else ever waits on the gate. When a producer holds the gate, the registrations are read
-- as before.
--
-- Key of the gate: 0x6378 in the top 16 bits, nothing below (outside the registrations' range, 0x6377).

CREATE OR REPLACE FUNCTION correlation_message_register_producer() RETURNS trigger
    LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    last_id bigint;
BEGIN
    IF current_setting('correlation_worker.producer', true) IS DISTINCT FROM 'registered' THEN
        PERFORM pg_advisory_xact_lock_shared(25464::bigint << 48);
        last_id := coalesce(pg_sequence_last_value(pg_get_serial_sequence(
            quote_ident(TG_TABLE_SCHEMA) || '.' || quote_ident(TG_TABLE_NAME), 'id')::regclass), 0);
        -- Key: 0x6377 in the top 16 bits, the last id in the low 48.
        PERFORM pg_advisory_xact_lock_shared((25463::bigint << 48) | least(last_id, 281474976710655));
        PERFORM set_config('correlation_worker.producer', 'registered', true);
    END IF;
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION correlation_order_horizon(OUT last_id bigint, OUT pin_ids bigint[], OUT pin_holders text[])
    LANGUAGE plpgsql AS $$
BEGIN
    last_id := coalesce(pg_sequence_last_value(pg_get_serial_sequence('correlation_message', 'id')::regclass), 0);
    BEGIN
        IF pg_try_advisory_xact_lock(25464::bigint << 48) THEN
            RAISE SQLSTATE 'CWG01';  -- the gate was free: rolled back with this block, which lets it go
        END IF;
    EXCEPTION WHEN SQLSTATE 'CWG01' THEN
        RETURN;  -- no producer transaction registered: no pins
    END;
    SELECT array_agg(((l.classid::bigint & 65535) << 32) | l.objid::bigint),
           array_agg(l.virtualtransaction)
      INTO pin_ids, pin_holders
      FROM pg_locks l
     WHERE l.locktype = 'advisory' AND l.objsubid = 1 AND l.granted
       AND l.classid::bigint BETWEEN 1668743168 AND 1668808703
       AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database());
END
$$;
