"""What importing the package and its command costs: each checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest


def _fresh(code: str) -> dict[str, object]:
    """Run ``code`` in a new interpreter; it prints one JSON object, returned."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, check=True)
    result: dict[str, object] = json.loads(done.stdout)
    return result


def test_importing_the_package_imports_no_library_until_a_name_is_asked_for() -> None:
    found = _fresh(
        """
        import json, sys
        import worker
        before = sorted(name for name in ("sqlalchemy", "pydantic", "psycopg") if name in sys.modules)
        from worker import AuthProblem, Message, MessageState, PermanentError, Reschedule, Result, Retry
        from worker.message import Message as Home
        missing = sorted(set(worker.__all__) - set(dir(worker)))
        print(json.dumps({"before": before, "same": Message is Home, "listed": missing, "retry": Retry.__module__}))
        """
    )
    assert found == {"before": [], "same": True, "listed": [], "retry": "worker.policy.outcomes"}


def test_an_unknown_name_of_the_package_is_an_attribute_error() -> None:
    import worker

    with pytest.raises(AttributeError, match="no attribute 'Nothing'"):
        worker.Nothing  # noqa: B018


@pytest.mark.parametrize("collecting", [True, False])
def test_the_command_is_imported_without_collections_and_its_objects_frozen(collecting: bool) -> None:
    found = _fresh(
        f"""
        import gc, json
        if not {collecting}:
            gc.disable()
        collections = []
        gc.callbacks.append(lambda phase, info: collections.append(info["generation"]) if phase == "start" else None)
        import worker.cli
        print(json.dumps({{"collections": collections, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}}))
        """
    )
    # At Python's thresholds the same imports ran about 200 collections, several of them of the oldest generation;
    # the few left are of the youngest, while the package's own module is imported (before the command's pause).
    collections = found["collections"]
    assert isinstance(collections, list) and len(collections) < 20 and set(collections) <= {0}
    assert found["enabled"] is collecting
    assert isinstance(found["frozen"], int) and found["frozen"] > 50_000


def test_the_command_imports_the_table_library_only_when_a_command_prints_a_table() -> None:
    found = _fresh(
        """
        import json, sys
        import worker.cli
        before = "tabulate" in sys.modules
        table = worker.cli._show_table({"id": 1, "message_name": "order.paid"})
        print(json.dumps({"before": before, "after": "tabulate" in sys.modules, "table": table}))
        """
    )
    assert found["before"] is False and found["after"] is True
    assert "order.paid" in str(found["table"])
