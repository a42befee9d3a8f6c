{{/*
Usage: {{ include "nim-llm.name" . }}
*/}}
{{- define "nim-llm.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Usage: {{ include "nim-llm.fullname" . }}
*/}}
{{- define "nim-llm.fullname" -}}
{{- if contains .Chart.Name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{/*
Selector labels: name and instance only, since selectors cannot change after install.
Usage: {{ include "nim-llm.selectorLabels" . }}
*/}}
{{- define "nim-llm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "nim-llm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Usage: {{ include "nim-llm.labels" . }}
*/}}
{{- define "nim-llm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "nim-llm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: inference
app.kubernetes.io/part-of: inferkiln
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
Usage: {{ include "nim-llm.serviceAccountName" . }}
*/}}
{{- define "nim-llm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "nim-llm.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The container image: repository@digest when image.digest is set (pinned to its content), else
repository:tag.
Usage: {{ include "nim-llm.image" . }}
*/}}
{{- define "nim-llm.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ required "image.tag or image.digest is required" .Values.image.tag }}
{{- end -}}
{{- end }}
