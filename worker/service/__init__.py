"""The process as a service: the HTTP endpoint, metrics and logs."""
