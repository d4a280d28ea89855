{{/* Names and labels shared by the chart's objects. */}}

{{- define "pagedllm.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release-qualified name, shortened to the 63 characters object names allow. */}}
{{- define "pagedllm.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "pagedllm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedllm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagedllm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "pagedllm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The image tag: the explicit one, else "cuda" or "cpu" by gpu.enabled. */}}
{{- define "pagedllm.image" -}}
{{- $tag := .Values.image.tag | default (ternary "cuda" "cpu" .Values.gpu.enabled) -}}
{{- printf "%s:%s" .Values.image.repository $tag }}
{{- end }}

{{/* The Secret holding the API key, or "" when no key is configured. */}}
{{- define "pagedllm.apiKeySecret" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else if .Values.apiKey.value }}
{{- printf "%s-api-key" (include "pagedllm.fullname" .) }}
{{- end }}
{{- end }}

{{- define "pagedllm.modelClaim" -}}
{{- .Values.model.pvc.existingClaim | default (printf "%s-models" (include "pagedllm.fullname" .)) }}
{{- end }}
