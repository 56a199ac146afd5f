{{/*
The worker's alerting rules, as one Prometheus rule list. Rendered into the PrometheusRule (prometheusrule.yaml)
and, with the default values, committed as deploy/alerts.yml for a plain Prometheus (deploy/alerts.py writes it;
a test fails when the two differ). Each alert's runbook: docs/operations.md, under the alert's name.

Cluster-wide figures are computed by one replica (the census) or summed over replicas, grouped by
(namespace, job): one deployment of the worker per group. A labelled counter is born at its first increment, so
`increase()` alone would miss the first event of a name: `(C unless C offset W) or increase(C[W])` counts a series
new within the window by its value.
*/}}
{{- define "correlation-worker.alertRules" -}}
{{- $t := .Values.prometheusRule.thresholds -}}
rules:
  - alert: CorrelationBacklogStalled
    expr: >-
      max by (namespace, job) (correlation_messages_by_state{state="ready"}) > 0
      unless on (namespace, job)
      sum by (namespace, job) (increase(correlation_messages_total[{{ $t.stalledFor }}])) > 0
    for: 2m
    labels:
      severity: critical
    annotations:
      summary: Messages are ready but none was correlated for {{ $t.stalledFor }}
      description: >-
        {{`{{ $value }}`}} message(s) of {{`{{ $labels.job }}`}} are ready to be correlated, and no replica made a
        correlator call for {{ $t.stalledFor }}: every replica stopped fetching (slots unheld, the database
        failing, every lane stuck).
  - alert: CorrelationOldestMessageTooOld
    expr: >-
      max by (namespace, job) (correlation_oldest_eligible_message_age_seconds) > {{ $t.oldestMessageSeconds }}
    for: 5m
    labels:
      severity: warning
    annotations:
      summary: The oldest message that could be correlated has waited too long
      description: >-
        The oldest eligible message of {{`{{ $labels.job }}`}} was created {{`{{ $value | humanizeDuration }}`}}
        ago (bound {{ $t.oldestMessageSeconds }} s): the backlog is not keeping up, or one hint is held back.
  - alert: CorrelationDeadLetters
    expr: >-
      sum by (namespace, job, message_name) (
      (correlation_messages_total{outcome="dead"} unless correlation_messages_total{outcome="dead"} offset {{ $t.deadWindow }})
      or increase(correlation_messages_total{outcome="dead"}[{{ $t.deadWindow }}])
      ) > 0
    labels:
      severity: warning
    annotations:
      summary: Messages of {{`{{ $labels.message_name }}`}} were dead-lettered
      description: >-
        {{`{{ $value | humanize }}`}} message(s) of {{`{{ $labels.message_name }}`}} ({{`{{ $labels.job }}`}}) were
        made dead in the last {{ $t.deadWindow }}: they wait for an operator (the console's dead letters, or
        `correlation-worker messages list --state dead`, then `requeue` or `delete`).
  - alert: CorrelationPoisonMessages
    expr: >-
      sum by (namespace, job, message_name) (
      (correlation_poison_messages_total unless correlation_poison_messages_total offset {{ $t.poisonWindow }})
      or increase(correlation_poison_messages_total[{{ $t.poisonWindow }}])
      ) > 0
    labels:
      severity: warning
    annotations:
      summary: Messages of {{`{{ $labels.message_name }}`}} crashed their replicas and were made dead
      description: >-
        {{`{{ $value | humanize }}`}} message(s) of {{`{{ $labels.message_name }}`}} ({{`{{ $labels.job }}`}}) were
        made dead as poison in the last {{ $t.poisonWindow }}: their replica died during each of their last calls.
  - alert: CorrelationUnreadableMessages
    expr: >-
      sum by (namespace, job, instance) (increase(correlation_unreadable_messages_total[{{ $t.deadWindow }}])) > 0
    labels:
      severity: warning
    annotations:
      summary: Rows the worker could not read were made dead
      description: >-
        {{`{{ $labels.instance }}`}} could not read {{`{{ $value | humanize }}`}} row(s) in the last
        {{ $t.deadWindow }} (a payload it cannot decode, a value out of range): each was made dead with the reason.
  - alert: CorrelationSlotsUnheld
    expr: >-
      (
      sum by (namespace, job) (correlation_slots_held)
      or sum by (namespace, job) (max_over_time(correlation_slots_held[1h])) * 0
      ) < {{ $t.slots }}
    for: 3m
    labels:
      severity: critical
    annotations:
      summary: Slots of the cluster are held by no replica
      description: >-
        The replicas of {{`{{ $labels.job }}`}} hold {{`{{ $value }}`}} of {{ $t.slots }} slots: the messages of the
        other slots are not correlated. A dead replica's slots are taken over within a lease term.
  - alert: CorrelationLeasesLost
    expr: >-
      sum by (namespace, job, instance) (increase(correlation_lease_losses_total[15m])) > {{ $t.leaseLosses }}
    labels:
      severity: warning
    annotations:
      summary: A replica keeps losing its slot leases
      description: >-
        {{`{{ $labels.instance }}`}} lost {{`{{ $value | humanize }}`}} slot lease(s) in 15 minutes before releasing
        them: its lease renewals are late (a frozen process, CPU throttling, a slow or failing database).
  - alert: CorrelationDatabaseErrors
    expr: >-
      sum by (namespace, job, instance, kind) (
      rate(correlation_database_errors_total{kind=~"unavailable|refused|read_only|schema"}[2m])
      ) > 0
    for: {{ $t.databaseErrorsFor }}
    labels:
      severity: critical
    annotations:
      summary: The database is {{`{{ $labels.kind }}`}} for a replica
      description: >-
        {{`{{ $labels.instance }}`}} has met database errors of kind {{`{{ $labels.kind }}`}} for
        {{ $t.databaseErrorsFor }} (unavailable: unreachable; refused: a login or privilege refused; read_only: a
        standby; schema: a table or column gone). /readyz says which.
  - alert: CorrelationOutcomesUnrecordable
    expr: >-
      sum by (namespace, job, instance) (increase(correlation_unrecordable_outcomes_total[15m])) > 0
    labels:
      severity: critical
    annotations:
      summary: The database refused to store outcomes
      description: >-
        {{`{{ $labels.instance }}`}} could not store {{`{{ $value | humanize }}`}} outcome(s) in 15 minutes (a
        trigger or constraint refusing the update): their messages were made dead with the reason, or, where not
        even that could be written, their hints are held back and the replica is not ready.
  - alert: CorrelationOutcomesNotWritten
    expr: >-
      sum by (namespace, job, instance) (rate(correlation_record_failures_total[2m])) > 0
    for: 10m
    labels:
      severity: warning
    annotations:
      summary: A replica cannot write its outcomes
      description: >-
        The flushes of outcomes of {{`{{ $labels.instance }}`}} have failed for 10 minutes (they are retried;
        nothing is lost, nothing called again, but its hints wait).
  - alert: CorrelationHandlerTimeouts
    expr: >-
      sum by (namespace, job, message_name) (
      (correlation_handler_timeouts_total unless correlation_handler_timeouts_total offset 15m)
      or increase(correlation_handler_timeouts_total[15m])
      ) > {{ $t.handlerTimeouts }}
    labels:
      severity: warning
    annotations:
      summary: Calls of {{`{{ $labels.message_name }}`}} outlast their handler timeout
      description: >-
        {{`{{ $value | humanize }}`}} call(s) of {{`{{ $labels.message_name }}`}} ({{`{{ $labels.job }}`}}) did not
        return within their handler timeout in 15 minutes: each was charged as a failed attempt.
  - alert: CorrelationCallsStuck
    expr: >-
      max by (namespace, job, instance) (correlation_hung_calls) > 0
    for: 5m
    labels:
      severity: warning
    annotations:
      summary: Correlator calls are stuck past their handler timeout
      description: >-
        {{`{{ $value }}`}} call(s) on {{`{{ $labels.instance }}`}} were given up after their handler timeout and have
        not returned for 5 minutes: each holds a thread and its hint; when they hold every lane, /healthz fails.
  - alert: CorrelationSlotsStalled
    expr: >-
      max by (namespace, job, instance) (correlation_stalled_slots) > 0
    for: 10m
    labels:
      severity: warning
    annotations:
      summary: Held slots make no progress
      description: >-
        {{`{{ $value }}`}} slot(s) held by {{`{{ $labels.instance }}`}} neither drained nor gave out work for 10
        minutes (fetches failing, or held back by a producer transaction left open).
  - alert: CorrelationTargetUnreachable
    expr: >-
      max by (namespace, job, target) (correlation_target_open) > 0
    for: {{ $t.targetOpenFor }}
    labels:
      severity: critical
    annotations:
      summary: The engine at {{`{{ $labels.target }}`}} is unreachable
      description: >-
        The circuit of {{`{{ $labels.target }}`}} has been open for {{ $t.targetOpenFor }}: its messages wait,
        uncharged, and a probe tries it now and then.
  - alert: CorrelationTargetBusy
    expr: >-
      sum by (namespace, job, target) (rate(correlation_target_held_total{reason="busy"}[5m])) > 0
    for: {{ $t.targetBusyFor }}
    labels:
      severity: warning
    annotations:
      summary: The engine at {{`{{ $labels.target }}`}} keeps pushing back
      description: >-
        {{`{{ $labels.target }}`}} has answered busy (429, RESOURCE_EXHAUSTED) for {{ $t.targetBusyFor }}: calls are
        paced below the replicas' capacity and the backlog may grow.
  - alert: CorrelationTargetAuthFailures
    expr: >-
      sum by (namespace, job, message_name) (
      (correlation_target_auth_failures_total unless correlation_target_auth_failures_total offset 10m)
      or increase(correlation_target_auth_failures_total[10m])
      ) > 0
    labels:
      severity: critical
    annotations:
      summary: A target refuses the worker's credentials
      description: >-
        Calls of {{`{{ $labels.message_name }}`}} ({{`{{ $labels.job }}`}}) were refused for the worker's
        credentials (401, 403 or a refused token) {{`{{ $value | humanize }}`}} time(s) in 10 minutes: they are
        retried until the credentials are fixed.
  - alert: CorrelationSchedulesInvalid
    expr: >-
      max by (namespace, job) (correlation_schedules_invalid) > 0
    for: 5m
    labels:
      severity: warning
    annotations:
      summary: Schedules cannot fire
      description: >-
        {{`{{ $value }}`}} schedule(s) of {{`{{ $labels.job }}`}} cannot fire: an invalid cron expression or time
        zone, or a message the database refuses. `correlation-worker schedules list` names them and why.
  - alert: CorrelationScheduleMisfires
    expr: >-
      sum by (namespace, job, schedule) (
      (correlation_schedule_misfires_total unless correlation_schedule_misfires_total offset 1h)
      or increase(correlation_schedule_misfires_total[1h])
      ) > 0
    labels:
      severity: warning
    annotations:
      summary: Schedule {{`{{ $labels.schedule }}`}} missed fire times
      description: >-
        {{`{{ $labels.schedule }}`}} ({{`{{ $labels.job }}`}}) missed {{`{{ $value | humanize }}`}} fire time(s) in the
        last hour, skipped by its misfire policy (the scheduler was off, or no replica ran).
  - alert: CorrelationScheduleOverdue
    expr: >-
      time() - min by (namespace, job, schedule) (correlation_schedule_next_fire_timestamp_seconds)
      > {{ $t.scheduleOverdueSeconds }}
    for: 5m
    labels:
      severity: warning
    annotations:
      summary: Schedule {{`{{ $labels.schedule }}`}} is overdue
      description: >-
        {{`{{ $labels.schedule }}`}} ({{`{{ $labels.job }}`}}) was due {{`{{ $value | humanizeDuration }}`}} ago and
        has not fired: no replica's scheduler is running it.
  - alert: CorrelationListenerDown
    expr: >-
      max by (namespace, job, instance) (correlation_listener_up) == 0
    for: 10m
    labels:
      severity: warning
    annotations:
      summary: A replica's wake-up listener is disconnected
      description: >-
        {{`{{ $labels.instance }}`}} has had no wake-up listener for 10 minutes: new messages wait for its next poll
        instead of being fetched at once.
  - alert: CorrelationRoutesDiffer
    expr: >-
      max by (namespace, job, instance) (correlation_replicas_routing_differently) > 0
    for: {{ $t.routesDifferFor }}
    labels:
      severity: critical
    annotations:
      summary: Replicas route message names differently, and those messages wait
      description: >-
        {{`{{ $labels.instance }}`}} has seen {{`{{ $value }}`}} live replica(s) with other routes for
        {{ $t.routesDifferFor }}: messages of the names they route differently are held, uncharged, until every
        replica has the same CORRELATION_CORRELATORS (`correlation-worker status` names them).
  - alert: CorrelationClusterSettingsDiffer
    expr: >-
      max by (namespace, job, instance) (correlation_cluster_settings_differing) > 0
    for: 30m
    labels:
      severity: warning
    annotations:
      summary: Replicas run cluster-wide settings with different values
      description: >-
        {{`{{ $labels.instance }}`}} has seen {{`{{ $value }}`}} cluster-wide setting(s) (delivery retention,
        leases, policies, ...) run differently by another live replica for 30 minutes (`correlation-worker
        status` names them and their values).
  - alert: CorrelationWorkerDown
    expr: >-
      up == 0 and on (job, instance) max_over_time(correlation_build_info[1h])
    for: 5m
    labels:
      severity: warning
    annotations:
      summary: A worker replica cannot be scraped
      description: >-
        {{`{{ $labels.instance }}`}} ({{`{{ $labels.job }}`}}) exported the worker's metrics within the hour and has
        not answered a scrape for 5 minutes.
{{- end }}
