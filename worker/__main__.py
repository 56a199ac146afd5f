"""``python -m worker`` is the ``correlation-worker`` command."""

from worker.cli import main

main()
