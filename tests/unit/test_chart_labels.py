"""The charts' axis labels (worker/admin/static/charts.js): compact numbers that fit the axis whatever the value.

The function is taken from the served file and run by Node where it is installed (the browser tests, which CI
runs, draw the charts themselves).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHARTS = Path(__file__).resolve().parents[2] / "worker" / "admin" / "static" / "charts.js"
AXIS_CHARACTERS = 6  # what the y axis (56 px) shows at the charts' font without cutting


def compact(values: list[float]) -> list[str]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    source = re.search(r"  function compact\(value\) \{.*?\n  \}\n", CHARTS.read_text(encoding="utf-8"), re.DOTALL)
    assert source is not None, "charts.js has no compact(value)"
    script = f"{source.group(0)}\nconsole.log(JSON.stringify({json.dumps(values)}.map(compact)));"
    done = subprocess.run([node, "-e", script], capture_output=True, text=True, timeout=30, check=True)
    return list(json.loads(done.stdout))


@pytest.mark.parametrize(
    ("value", "label"),
    [
        (0, "0"), (0.25, "0.25"), (950, "950"), (1000, "1k"), (12_500, "12.5k"), (100_000, "100k"),
        (250_000, "250k"), (1_200_000, "1.2M"), (35_000_000, "35M"), (1_234_567_890, "1.2G"), (-2500, "-2.5k"),
    ],
)
def test_axis_labels_are_compact_numbers(value: float, label: str) -> None:
    assert compact([value]) == [label]


def test_no_axis_label_is_longer_than_the_axis_shows() -> None:
    values = [10**exponent * mantissa for exponent in range(0, 15) for mantissa in (1, 1.5, 9.99, 5)]
    assert all(len(label) <= AXIS_CHARACTERS for label in compact(values)), compact(values)


def test_the_y_axis_draws_its_labels_with_it() -> None:
    assert "values: function (u, splits) { return splits.map(compact); }" in CHARTS.read_text(encoding="utf-8")
