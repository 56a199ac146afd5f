"""Pure rules: backoff, eligibility and batching, outcomes, printable text. No I/O, no clock reads."""
