"""Pure rules: backoff, eligibility and batching, outcomes. No I/O, no clock reads."""
