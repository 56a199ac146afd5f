"""Background services of a replica: slot leases, correlation, cleanup, the state census."""
