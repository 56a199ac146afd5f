{{/*
Chart name, truncated to the 63 characters a label value allows.
*/}}
{{- define "correlation-worker.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name: release-chart unless the release name already contains the chart name.
*/}}
{{- define "correlation-worker.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "correlation-worker.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels shared by every resource of the release (no component: see the selector helpers).
*/}}
{{- define "correlation-worker.labels" -}}
helm.sh/chart: {{ include "correlation-worker.chart" . }}
app.kubernetes.io/name: {{ include "correlation-worker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Selector of the worker pods. The component label keeps the migration Job's pod out of the Service, the
ServiceMonitor and the PodDisruptionBudget.
*/}}
{{- define "correlation-worker.selectorLabels" -}}
app.kubernetes.io/name: {{ include "correlation-worker.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: worker
{{- end }}

{{- define "correlation-worker.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "correlation-worker.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "correlation-worker.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
The Secret the worker pods read the database URL from: the existing one, or the one the chart creates.
*/}}
{{- define "correlation-worker.databaseSecretName" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecret }}
{{- else }}
{{- printf "%s-database" (include "correlation-worker.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
The Secret the migration hook reads the database URL from. A pre-install hook runs before any non-hook
resource of the release exists, so when the chart holds the URL it writes a second copy as a hook resource
with a lower weight than the Job; an existing Secret is used as it is.
*/}}
{{- define "correlation-worker.migrationSecretName" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecret }}
{{- else }}
{{- printf "%s-migrate-database" (include "correlation-worker.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "correlation-worker.databaseSecretKey" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecretKey }}
{{- else -}}
url
{{- end }}
{{- end }}

{{/*
Fail early on settings the schema cannot express.
*/}}
{{- define "correlation-worker.validate" -}}
{{- if and .Values.database.url .Values.database.existingSecret }}
{{- fail "database: set either database.url or database.existingSecret, not both" }}
{{- end }}
{{- if not (or .Values.database.url .Values.database.existingSecret) }}
{{- fail "database: set database.url or database.existingSecret (with database.existingSecretKey)" }}
{{- end }}
{{- if le (int .Values.terminationGracePeriodSeconds) (int .Values.shutdown.graceSeconds) }}
{{- fail "terminationGracePeriodSeconds must be greater than shutdown.graceSeconds, or Kubernetes kills the worker before it has finished its current message" }}
{{- end }}
{{- end }}

{{/*
Environment of the worker and of the migration Job. Argument: dict "ctx" $ "secretName" name.
*/}}
{{- define "correlation-worker.env" -}}
{{- $ctx := .ctx -}}
- name: CORRELATION_DATABASE__URL
  valueFrom:
    secretKeyRef:
      name: {{ .secretName }}
      key: {{ include "correlation-worker.databaseSecretKey" $ctx }}
- name: CORRELATION_DATABASE__AUTO_MIGRATE
  value: {{ $ctx.Values.database.autoMigrate | toString | quote }}
- name: CORRELATION_REPLICA__NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: CORRELATION_METRICS__PORT
  value: {{ $ctx.Values.metrics.port | quote }}
- name: CORRELATION_LOG__FORMAT
  value: {{ $ctx.Values.log.format | quote }}
- name: CORRELATION_LOG__LEVEL
  value: {{ $ctx.Values.log.level | quote }}
- name: CORRELATION_SHUTDOWN__GRACE
  value: {{ printf "PT%dS" (int $ctx.Values.shutdown.graceSeconds) | quote }}
{{- with $ctx.Values.correlators }}
- name: CORRELATION_CORRELATORS
  value: {{ toJson . | quote }}
{{- end }}
{{- with $ctx.Values.policies }}
- name: CORRELATION_POLICIES
  value: {{ toJson . | quote }}
{{- end }}
{{- range $name, $value := $ctx.Values.env }}
- name: {{ $name }}
  value: {{ $value | toString | quote }}
{{- end }}
{{- with $ctx.Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The Camunda SDK's variables for the camunda8 correlator: plain settings as values, credentials from the existing
Secret (OAUTH: client id and secret; BASIC: user name and password).
*/}}
{{- define "correlation-worker.camundaEnv" -}}
{{- $c := .Values.camunda -}}
{{- range $name, $value := dict "CAMUNDA_REST_ADDRESS" $c.restAddress "CAMUNDA_AUTH_STRATEGY" $c.authStrategy "CAMUNDA_OAUTH_URL" $c.oauthUrl "CAMUNDA_TOKEN_AUDIENCE" $c.tokenAudience "CAMUNDA_TENANT_ID" $c.tenantId }}
{{- if $value }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
{{- if $c.existingSecret }}
{{- $keys := $c.existingSecretKeys }}
{{- $pairs := list }}
{{- if eq $c.authStrategy "BASIC" }}
{{- $pairs = list (list "CAMUNDA_BASIC_AUTH_USERNAME" $keys.username) (list "CAMUNDA_BASIC_AUTH_PASSWORD" $keys.password) }}
{{- else }}
{{- $pairs = list (list "CAMUNDA_CLIENT_ID" $keys.clientId) (list "CAMUNDA_CLIENT_SECRET" $keys.clientSecret) }}
{{- end }}
{{- range $pairs }}
- name: {{ index . 0 }}
  valueFrom:
    secretKeyRef:
      name: {{ $c.existingSecret }}
      key: {{ index . 1 }}
{{- end }}
{{- end }}
{{- end }}
