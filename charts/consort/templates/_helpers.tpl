{{- define "consort.name" -}}consort-operator{{- end -}}

{{- define "consort.fullname" -}}
{{- if contains "consort" .Release.Name -}}
{{- printf "%s-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-consort-operator" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "consort.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}{{ default (include "consort.fullname" .) .Values.serviceAccount.name }}{{- else -}}{{ default "default" .Values.serviceAccount.name }}{{- end -}}
{{- end -}}

{{- define "consort.selectorLabels" -}}
app.kubernetes.io/name: {{ include "consort.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "consort.labels" -}}
{{ include "consort.selectorLabels" . }}
app.kubernetes.io/component: operator
app.kubernetes.io/part-of: consort
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- /* The namespaces the operator watches, as a prometheus-operator namespaceSelector. */ -}}
{{- define "consort.watchedNamespaceSelector" -}}
namespaceSelector:
{{- if .Values.watchNamespaces }}
  matchNames: {{ toJson .Values.watchNamespaces }}
{{- else }}
  any: true
{{- end }}
{{- end -}}
