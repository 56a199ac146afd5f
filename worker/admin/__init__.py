"""Operator actions shared by the CLI (and the HTTP API and pages)."""
