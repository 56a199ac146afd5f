"""The correlation-worker Grafana dashboard, built with Grafana's own Python builders (grafana-foundation-sdk).

Run it after changing a panel; it writes the same JSON to both places that ship it:

    .venv/bin/python deploy/grafana/dashboard.py

- deploy/grafana/correlation-worker.json: provisioned by docker-compose.yml's grafana service;
- helm/correlation-worker/dashboards/correlation-worker.json: the chart's ConfigMap for the Grafana sidecar
  (`grafanaDashboard.enabled`).

tests/deploy/test_dashboard.py fails while either file differs from what this script generates, checks that every
expression names only metrics the worker exports and that promtool parses it.

The dashboard is the classic JSON model (the SDK's `dashboard` builders, which warn on import that they prefer
`dashboardv2`): Grafana 12 loads the v2 schema only behind feature flags, while file provisioning and the Helm
chart's sidecar take the classic model on every Grafana from 10 on.

Every query filters on the `job` variable. Panels of one replica's doings (calls, slots, lanes, targets, database,
schedules) also filter on `instance`; the census panels (backlog, oldest eligible message) and the throughput
panel do not: one replica exports the census (the holder of the `gauges` lock), and the others export none of
it, or 0 for the oldest age, so those use `max` over the job's replicas.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from pathlib import Path

from grafana_foundation_sdk.builders import common as common_builders
from grafana_foundation_sdk.builders import dashboard, prometheus, stat, timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models import common
from grafana_foundation_sdk.models.dashboard import (
    DashboardCursorSync,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)

REPO_ROOT = Path(__file__).resolve().parents[2]
OUTPUTS = (
    REPO_ROOT / "deploy" / "grafana" / "correlation-worker.json",
    REPO_ROOT / "helm" / "correlation-worker" / "dashboards" / "correlation-worker.json",
)

UID = "correlation-worker"
TITLE = "correlation-worker"
DATASOURCE = common.DataSourceRef(type_val="prometheus", uid="${datasource}")

# Label matchers: the job's replicas (census and cluster panels), or the replicas chosen by `instance`.
JOB = 'job=~"$job"'
REPLICAS = 'job=~"$job", instance=~"$instance"'


def sel(metric: str, matchers: str = REPLICAS, extra: str = "") -> str:
    """A selector of one metric: `metric{job=~"$job", instance=~"$instance", extra}`."""
    inner = f"{matchers}, {extra}" if extra else matchers
    return f"{metric}{{{inner}}}"


def eq(label: str, value: str) -> str:
    """A label matcher `label="value"`."""
    return f'{label}="{value}"'


def ne(label: str, value: str) -> str:
    """A label matcher `label!="value"`."""
    return f'{label}!="{value}"'


def match(label: str, pattern: str) -> str:
    """A label matcher `label=~"pattern"`."""
    return f'{label}=~"{pattern}"'


def rate(metric: str, matchers: str = REPLICAS, extra: str = "") -> str:
    """The per-second rate of a counter over Grafana's rate interval."""
    return f"rate({sel(metric, matchers, extra)}[$__rate_interval])"


def increase(metric: str, matchers: str = REPLICAS, extra: str = "") -> str:
    """A counter's increase over Grafana's rate interval (rare events: counts read better than rates)."""
    return f"increase({sel(metric, matchers, extra)}[$__rate_interval])"


def quantile(q: float, by: str) -> str:
    """A percentile of correlator call durations grouped by `by` (plus `le`)."""
    group = f"{by}, le" if by else "le"
    return (
        f"histogram_quantile({q}, sum by ({group}) ({rate('correlation_call_duration_seconds_bucket')}))"
    )


def query(expr: str, legend: str) -> prometheus.Dataquery:
    """A Prometheus range query on the dashboard's datasource."""
    return prometheus.Dataquery().expr(expr).legend_format(legend).datasource(DATASOURCE).range()


def graph(
    title: str,
    description: str,
    targets: Sequence[prometheus.Dataquery],
    *,
    unit: str = "short",
    width: int = 8,
    stacked: bool = False,
    minimum: float | None = 0,
    maximum: float | None = None,
) -> timeseries.Panel:
    """A time series panel."""
    panel = (
        timeseries.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(8)
        .fill_opacity(10)
        .line_width(1)
        .legend(
            common_builders.VizLegendOptions()
            .display_mode(common.LegendDisplayMode.LIST)
            .placement(common.LegendPlacement.BOTTOM)
            .show_legend(True)
        )
        .tooltip(
            common_builders.VizTooltipOptions()
            .mode(common.TooltipDisplayMode.MULTI)
            .sort(common.SortOrder.DESCENDING)
        )
    )
    if stacked:
        panel = panel.stacking(common_builders.StackingConfig().mode(common.StackingMode.NORMAL)).fill_opacity(40)
    if minimum is not None:
        panel = panel.min(minimum)
    if maximum is not None:
        panel = panel.max(maximum)
    for index, target in enumerate(targets):
        panel = panel.with_target(target.ref_id(chr(ord("A") + index)))
    return panel


def single(
    title: str,
    description: str,
    target: prometheus.Dataquery,
    *,
    unit: str = "short",
    width: int = 4,
    red_at: float | None = None,
    green_at_one: bool = False,
) -> stat.Panel:
    """A stat panel with the last value and a sparkline; red from `red_at` on (or green only at 1)."""
    if green_at_one:
        steps = [Threshold(value=None, color="red"), Threshold(value=1, color="green")]
    elif red_at is not None:
        steps = [Threshold(value=None, color="green"), Threshold(value=red_at, color="red")]
    else:
        steps = [Threshold(value=None, color="text")]
    return (
        stat.Panel()
        .title(title)
        .description(description)
        .datasource(DATASOURCE)
        .unit(unit)
        .span(width)
        .height(4)
        .graph_mode(common.BigValueGraphMode.AREA)
        .color_mode(common.BigValueColorMode.VALUE)
        .reduce_options(common_builders.ReduceDataOptions().calcs(["lastNotNull"]).values(False))
        .thresholds(dashboard.ThresholdsConfig().mode(ThresholdsMode.ABSOLUTE).steps(steps))
        .with_target(target.ref_id("A"))
    )


def _overview() -> list[stat.Panel]:
    return [
        single(
            "Replicas up",
            "Worker replicas of the job Prometheus scrapes successfully now (the `up` series of its targets).",
            query(f"sum({sel('up', JOB)})", "up"),
        ),
        single(
            "Ready messages",
            "Messages ready to be correlated now, from the census one replica takes (max over the job's replicas).",
            query(f"max({sel('correlation_messages_by_state', JOB, eq('state', 'ready'))})", "ready"),
        ),
        single(
            "Oldest eligible message",
            "Age of the oldest message that could be correlated now: growing steadily means the worker falls behind.",
            query(f"max({sel('correlation_oldest_eligible_message_age_seconds', JOB)})", "oldest"),
            unit="s",
            red_at=900,
        ),
        single(
            "Delivered / s",
            "Successful correlator calls per second over the job's replicas.",
            query(f"sum({rate('correlation_messages_total', JOB, eq('outcome', 'success'))})", "success"),
            unit="ops",
        ),
        single(
            "Dead messages",
            "Dead messages in the table (given up on; requeue or delete them): any is worth a look.",
            query(f"max({sel('correlation_messages_by_state', JOB, eq('state', 'dead'))})", "dead"),
            red_at=1,
        ),
        single(
            "Slots held",
            "Slots the job's replicas lease together (64 on PostgreSQL): fewer means slots nobody works on.",
            query(f"sum({sel('correlation_slots_held', JOB)})", "slots"),
        ),
    ]


def _throughput() -> list[timeseries.Panel]:
    census_total = f"sum(max by (state) ({sel('correlation_messages_by_state', JOB)}))"
    delivered = f"sum({rate('correlation_messages_total', JOB, eq('outcome', 'success'))})"
    removed = f"sum({rate('correlation_cleanup_removed_messages_total', JOB)})"
    return [
        graph(
            "Throughput in (estimated) and out",
            "The worker counts no arrivals: in = growth of the census + deliveries + expired messages removed "
            "(misses operator deletes); out = successful calls. In above out for long means a growing backlog.",
            [
                query(f"clamp_min(deriv({census_total}[$__rate_interval:]) + {delivered} + {removed}, 0)", "in (est.)"),
                query(delivered, "out (delivered)"),
            ],
            unit="ops",
            width=12,
        ),
        graph(
            "Correlator calls by outcome",
            "Calls per second of the job's replicas by outcome: success, retry, buffered, rescheduled, dead, "
            "abandoned (given up at shutdown).",
            [query(f"sum by (outcome) ({rate('correlation_messages_total', JOB)})", "{{outcome}}")],
            unit="ops",
            width=12,
            stacked=True,
        ),
    ]


def _backlog() -> list[timeseries.Panel]:
    return [
        graph(
            "Backlog by state",
            "Messages in the table by state (ready, waiting = due later, paused, dead, expired = awaiting cleanup), "
            "from the one replica that takes the census.",
            [query(f"max by (state) ({sel('correlation_messages_by_state', JOB)})", "{{state}}")],
            width=8,
        ),
        graph(
            "Oldest eligible message age",
            "Seconds the oldest message that could be correlated now has waited: a sawtooth is healthy, a ramp "
            "means a stuck hint, a stalled slot or too little capacity.",
            [query(f"max({sel('correlation_oldest_eligible_message_age_seconds', JOB)})", "oldest eligible")],
            unit="s",
            width=8,
        ),
        graph(
            "Backlog by message name",
            "Live messages (ready, waiting, paused) by message name; the 50 largest names, the rest as `other`.",
            [
                query(
                    "sum by (message_name) (max by (message_name, state) "
                    f"({sel('correlation_backlog_messages', JOB, match('state', 'ready|waiting|paused'))}))",
                    "{{message_name}}",
                )
            ],
            width=8,
            stacked=True,
        ),
    ]


def _outcomes() -> list[timeseries.Panel]:
    calls = "correlation_messages_total"
    return [
        graph(
            "Calls by message name and outcome",
            "Correlator calls per second of the chosen replicas by message name and outcome.",
            [query(f"sum by (message_name, outcome) ({rate(calls)})", "{{message_name}} {{outcome}}")],
            unit="ops",
            width=12,
        ),
        graph(
            "Success ratio by message name",
            "Share of calls that succeeded, by message name (abandoned calls left out): a drop names the "
            "message whose target or payload fails.",
            [
                query(
                    f"sum by (message_name) ({rate(calls, extra=eq('outcome', 'success'))}) / "
                    f"sum by (message_name) ({rate(calls, extra=ne('outcome', 'abandoned'))})",
                    "{{message_name}}",
                )
            ],
            unit="percentunit",
            width=12,
            maximum=1,
        ),
    ]


def _latency() -> list[timeseries.Panel]:
    return [
        graph(
            "Call latency (all calls)",
            "p50, p90 and p99 of one correlator call over the chosen replicas.",
            [query(quantile(q, ""), f"p{round(q * 100)}") for q in (0.5, 0.9, 0.99)],
            unit="s",
            width=8,
        ),
        graph(
            "Call latency by message name",
            "p50, p90 and p99 of one call by message name (the message name picks the call's route); the "
            "first 50 names keep their own label.",
            [
                query(quantile(q, "message_name"), f"p{round(q * 100)} {{{{message_name}}}}")
                for q in (0.5, 0.9, 0.99)
            ],
            unit="s",
            width=8,
        ),
        graph(
            "Handler timeouts by message name",
            "Calls that did not return within their handler timeout (each charged as a failed attempt).",
            [
                query(
                    f"sum by (message_name) ({increase('correlation_handler_timeouts_total')})",
                    "{{message_name}}",
                )
            ],
            width=8,
        ),
        graph(
            "Batch and fetch duration (p99)",
            "p99 of one hint's batch (first call to last) and of one slot's fetch (candidates and batches).",
            [
                query(
                    "histogram_quantile(0.99, sum by (le) "
                    f"({rate('correlation_batch_duration_seconds_bucket')}))",
                    "batch p99",
                ),
                query(
                    "histogram_quantile(0.99, sum by (le) "
                    f"({rate('correlation_fetch_duration_seconds_bucket')}))",
                    "fetch p99",
                ),
            ],
            unit="s",
            width=24,
        ),
    ]


def _failures() -> list[timeseries.Panel]:
    failed = match("outcome", "retry|dead|buffered|rescheduled")
    return [
        graph(
            "Retries and dead letters",
            "Failed calls per second by what became of the message: retry, buffered (failure inside its "
            "time to live), rescheduled, dead (given up: needs an operator).",
            [
                query(f"sum by (outcome) ({rate('correlation_messages_total', extra=failed)})", "{{outcome}}")
            ],
            unit="ops",
            width=8,
        ),
        graph(
            "Poison messages",
            "Messages made dead after poison_after crashes of their calls (their replica died mid-call), by "
            "message name: any is a bug or a payload that kills the worker.",
            [
                query(
                    f"sum by (message_name) ({increase('correlation_poison_messages_total')})",
                    "{{message_name}}",
                )
            ],
            width=8,
        ),
        graph(
            "Dead messages by message name",
            "Dead messages in the table by message name (census): which producer's messages to look at.",
            [
                query(
                    f"max by (message_name) ({sel('correlation_backlog_messages', JOB, eq('state', 'dead'))})",
                    "{{message_name}}",
                )
            ],
            width=8,
        ),
        graph(
            "Lost, redelivered and refused",
            "Calls found in flight at a takeover, their redeliveries, fenced commits, and rows the worker could "
            "not read or whose outcome the database refused (both made dead).",
            [
                query(f"sum({increase('correlation_lost_calls_total')})", "lost calls"),
                query(f"sum({increase('correlation_redeliveries_total')})", "redeliveries"),
                query(f"sum({increase('correlation_fenced_commits_total')})", "fenced commits"),
                query(f"sum({increase('correlation_unreadable_messages_total')})", "unreadable"),
                query(f"sum({increase('correlation_unrecordable_outcomes_total')})", "unrecordable"),
            ],
            width=24,
        ),
    ]


def _slots() -> list[timeseries.Panel]:
    return [
        graph(
            "Slots held by replica",
            "Slots each replica leases (stacked: the total is the cluster's slots; 64 on PostgreSQL). A replica "
            "at 0 does no work.",
            [query(f"sum by (instance) ({sel('correlation_slots_held')})", "{{instance}}")],
            width=8,
            stacked=True,
        ),
        graph(
            "Lease acquisitions and losses",
            "Slot leases acquired and lost before release (expired or taken over) per replica: losses outside "
            "a rollout mean a replica that cannot renew in time.",
            [
                query(
                    f"sum by (instance) ({increase('correlation_lease_acquisitions_total')})",
                    "acquired {{instance}}",
                ),
                query(f"sum by (instance) ({increase('correlation_lease_losses_total')})", "lost {{instance}}"),
            ],
            width=8,
        ),
        graph(
            "Stalled slots",
            "Held slots without progress for longer than max(60 s, 3 poll intervals): fetches failing, or held "
            "back by an open producer transaction.",
            [query(f"max by (instance) ({sel('correlation_stalled_slots')})", "{{instance}}")],
            width=8,
        ),
        graph(
            "Slot progress age",
            "Seconds since the held slot waiting longest last drained or gave out work, per replica.",
            [query(f"max by (instance) ({sel('correlation_slot_progress_age_seconds')})", "{{instance}}")],
            unit="s",
            width=12,
        ),
        graph(
            "Calls running and hung",
            "Calls running now (busy lanes) and calls given up after their handler timeout that have not "
            "returned (hung: they hold a lane until they do).",
            [
                query(f"sum by (instance) ({sel('correlation_busy_lanes')})", "busy {{instance}}"),
                query(f"sum by (instance) ({sel('correlation_hung_calls')})", "hung {{instance}}"),
            ],
            width=12,
        ),
    ]


def _targets() -> list[timeseries.Panel]:
    return [
        graph(
            "Target circuits open",
            "1 while a network target's circuit is open or half-open (no call goes there but a probe), per "
            "replica and target.",
            [query(f"max by (instance, target) ({sel('correlation_target_open')})", "{{target}} {{instance}}")],
            width=8,
            maximum=1,
        ),
        graph(
            "Target answers",
            "Answers per second by target and what they said: success, message (the message's own failure), "
            "failure (charged), unavailable and busy (not charged).",
            [
                query(
                    f"sum by (target, answer) ({rate('correlation_target_answers_total')})",
                    "{{target}} {{answer}}",
                )
            ],
            unit="ops",
            width=8,
        ),
        graph(
            "Calls held back by target",
            "Calls held back by their target with no attempt charged: open circuit, or busy / unavailable "
            "(due again at the target's Retry-After).",
            [
                query(
                    f"sum by (target, reason) ({rate('correlation_target_held_total')})",
                    "{{target}} {{reason}}",
                )
            ],
            unit="ops",
            width=8,
        ),
        graph(
            "Target concurrency limit",
            "Calls a target may have in flight from each replica now: lowered by back-pressure (busy answers), "
            "raised again as it recovers.",
            [
                query(
                    f"max by (instance, target) ({sel('correlation_target_concurrency_limit')})",
                    "{{target}} {{instance}}",
                )
            ],
            width=8,
        ),
        graph(
            "Circuit transitions",
            "Times a target's circuit changed, by the state it went to (open, half_open, closed).",
            [
                query(
                    f"sum by (target, state) ({increase('correlation_target_transitions_total')})",
                    "{{target}} {{state}}",
                )
            ],
            width=8,
        ),
        graph(
            "Target auth failures",
            "Calls the target refused for the worker's credentials (401/403, or a refused token request), by "
            "message name: any is a credential to fix.",
            [
                query(
                    f"sum by (message_name) ({increase('correlation_target_auth_failures_total')})",
                    "{{message_name}}",
                )
            ],
            width=8,
        ),
    ]


def _database() -> list[timeseries.Panel]:
    return [
        graph(
            "Database errors by kind",
            "Failed database operations per second: unavailable, timeout (retried), refused (login or "
            "privilege), read_only (a standby after a failover), schema (a table or column gone), other.",
            [query(f"sum by (kind) ({rate('correlation_database_errors_total')})", "{{kind}}")],
            unit="ops",
            width=8,
        ),
        graph(
            "Writes retried and fetches failed",
            "Outcome flushes that failed and were retried, outcomes deferred behind another session's row lock, "
            "and slot fetches that failed (fetched again after a backoff).",
            [
                query(f"sum({increase('correlation_record_failures_total')})", "record failures"),
                query(f"sum({increase('correlation_deferred_outcomes_total')})", "deferred outcomes"),
                query(f"sum({increase('correlation_fetch_errors_total')})", "fetch errors"),
            ],
            width=8,
        ),
        graph(
            "Wake-up listener",
            "1 while a replica's wake-up listener (LISTEN, or the SQLite watcher) is connected; its reconnects "
            "(each followed by a look at every slot).",
            [
                query(f"max by (instance) ({sel('correlation_listener_up')})", "up {{instance}}"),
                query(
                    f"sum by (instance) ({increase('correlation_listener_reconnects_total')})",
                    "reconnects {{instance}}",
                ),
            ],
            width=8,
        ),
        graph(
            "Producer order waits",
            "Fetches held back by an open producer transaction with an earlier id, and producer transactions "
            "passed over after order.max_wait.",
            [
                query(f"sum({increase('correlation_order_waits_total')})", "waits"),
                query(f"sum({increase('correlation_order_wait_timeouts_total')})", "wait timeouts"),
            ],
            width=12,
        ),
        graph(
            "Cleanup",
            "Expired messages and old delivery records removed by cleanup.",
            [
                query(f"sum({increase('correlation_cleanup_removed_messages_total')})", "expired messages"),
                query(f"sum({increase('correlation_cleanup_removed_records_total')})", "delivery records"),
            ],
            width=12,
        ),
    ]


def _schedules() -> list[stat.Panel | timeseries.Panel]:
    return [
        graph(
            "Schedule fires",
            "Messages published by schedules' fire times, by schedule (summed over the chosen replicas).",
            [query(f"sum by (schedule) ({increase('correlation_schedule_fires_total')})", "{{schedule}}")],
            width=8,
        ),
        graph(
            "Misfires and skipped fire times",
            "Fire times skipped: by the misfire policy, because the last message was still pending "
            "(singleton), or because the time zone skips them (clocks springing forward).",
            [
                query(f"sum by (schedule) ({increase('correlation_schedule_misfires_total')})", "misfire {{schedule}}"),
                query(
                    f"sum by (schedule) ({increase('correlation_schedule_singleton_skips_total')})",
                    "singleton skip {{schedule}}",
                ),
                query(
                    f"sum by (schedule) ({increase('correlation_schedule_nonexistent_times_total')})",
                    "nonexistent {{schedule}}",
                ),
            ],
            width=8,
        ),
        graph(
            "Time to next fire",
            "Seconds until each schedule's next fire time (negative: overdue, the scheduler is off or behind).",
            [
                query(
                    f"max by (schedule) ({sel('correlation_schedule_next_fire_timestamp_seconds', JOB)}) - time()",
                    "{{schedule}}",
                )
            ],
            unit="s",
            width=8,
            minimum=None,
        ),
        single(
            "Invalid schedules",
            "Schedules that cannot fire because their cron expression or time zone is invalid.",
            query(f"max({sel('correlation_schedules_invalid', JOB)})", "invalid"),
            red_at=1,
            width=12,
        ),
        single(
            "Scheduler enabled",
            "1 while the scheduler is switched on, on every replica of the job (min over them).",
            query(f"min({sel('correlation_scheduler_enabled', JOB)})", "enabled"),
            green_at_one=True,
            width=12,
        ),
    ]


def _process() -> list[timeseries.Panel]:
    return [
        graph(
            "CPU",
            "CPU seconds per second each replica's process uses.",
            [query(f"sum by (instance) ({rate('process_cpu_seconds_total')})", "{{instance}}")],
            unit="percentunit",
            width=8,
        ),
        graph(
            "Resident memory",
            "Resident memory of each replica's process.",
            [query(f"max by (instance) ({sel('process_resident_memory_bytes')})", "{{instance}}")],
            unit="bytes",
            width=8,
        ),
        graph(
            "Versions",
            "Replicas running each version (correlation_build_info): two during a rollout, one otherwise.",
            [query(f"count by (version) ({sel('correlation_build_info')})", "{{version}}")],
            width=8,
        ),
    ]


ROWS = (
    ("Overview", _overview),
    ("Throughput", _throughput),
    ("Backlog", _backlog),
    ("Outcomes by message name", _outcomes),
    ("Call latency", _latency),
    ("Retries, dead letters and poison", _failures),
    ("Slots, leases and lanes", _slots),
    ("Targets (engines)", _targets),
    ("Database", _database),
    ("Schedules", _schedules),
    ("Process", _process),
)


def variables() -> list[dashboard.DatasourceVariable | dashboard.QueryVariable]:
    """The datasource, the job and the replicas (instances) the panels show."""
    return [
        dashboard.DatasourceVariable("datasource").label("Data source").type("prometheus"),
        dashboard.QueryVariable("job")
        .label("Job")
        .datasource(DATASOURCE)
        .query("label_values(correlation_build_info, job)")
        .definition("label_values(correlation_build_info, job)")
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC),
        dashboard.QueryVariable("instance")
        .label("Replica")
        .datasource(DATASOURCE)
        .query('label_values(correlation_build_info{job=~"$job"}, instance)')
        .definition('label_values(correlation_build_info{job=~"$job"}, instance)')
        .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
        .sort(VariableSort.ALPHABETICAL_ASC)
        .multi(True)
        .include_all(True)
        .all_value(".+"),
    ]


def build() -> dashboard.Dashboard:
    """The dashboard builder: one row per area, panels numbered in order."""
    board = (
        dashboard.Dashboard(TITLE)
        .uid(UID)
        .description("Throughput, backlog, calls, slots, targets, database and schedules of correlation-worker.")
        .tags(["correlation-worker"])
        .editable()
        .tooltip(DashboardCursorSync.CROSSHAIR)
        .refresh("30s")
        .time("now-3h", "now")
        .timezone(common.TimeZoneBrowser)
        .variables(variables())  # type: ignore[arg-type]  # a list of builders of one model, invariant in mypy
    )
    panel_id = 0
    for title, panels in ROWS:
        panel_id += 1
        board = board.with_row(dashboard.Row(title).id(panel_id))
        for panel in panels():
            panel_id += 1
            board = board.with_panel(panel.id(panel_id))
    return board


def dashboard_json() -> str:
    """The dashboard as the files hold it: sorted keys, two-space indent, a trailing newline."""
    model = build().build()
    return json.dumps(model, cls=JSONEncoder, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def main(argv: Sequence[str] = ()) -> int:
    """Write the dashboard to both places; `--check` only reports whether they are current."""
    text = dashboard_json()
    if "--check" in argv:
        stale = [path for path in OUTPUTS if not path.exists() or path.read_text(encoding="utf-8") != text]
        for path in stale:
            print(f"{path.relative_to(REPO_ROOT)} is out of date: run deploy/grafana/dashboard.py", file=sys.stderr)
        return 1 if stale else 0
    for path in OUTPUTS:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path.relative_to(REPO_ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
