{{/*
Chart name, overridable with nameOverride.
*/}}
{{- define "gpupool.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Prefix of every object name: fullnameOverride, else the release name when it
already contains the chart name, else "<release>-<chart>". Kept to 40
characters so "-device-plugin-metrics" still fits in 63.
*/}}
{{- define "gpupool.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- $name := include "gpupool.name" . }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 40 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gpupool.operator.fullname" -}}
{{- printf "%s-operator" (include "gpupool.fullname" .) }}
{{- end }}

{{- define "gpupool.devicePlugin.fullname" -}}
{{- printf "%s-device-plugin" (include "gpupool.fullname" .) }}
{{- end }}

{{/*
Labels on every object.
*/}}
{{- define "gpupool.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
app.kubernetes.io/name: {{ include "gpupool.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: gpupool
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels of one component; call with (dict "ctx" $ "component" "operator").
*/}}
{{- define "gpupool.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpupool.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
All labels of one component's objects.
*/}}
{{- define "gpupool.componentLabels" -}}
{{ include "gpupool.labels" .ctx }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Image reference; call with (dict "ctx" $ "image" .Values.operator.image).
*/}}
{{- define "gpupool.image" -}}
{{- printf "%s:%s" .image.repository (default .ctx.Chart.AppVersion .image.tag) }}
{{- end }}

{{/*
Container security settings shared by both workloads: no privilege
escalation, no capabilities, read-only root filesystem, RuntimeDefault seccomp.
*/}}
{{- define "gpupool.containerSecurity" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}
