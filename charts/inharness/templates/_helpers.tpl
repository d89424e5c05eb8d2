{{/* Object names: `<release>-inharness`, or the release name when it already contains the chart's. */}}
{{- define "inharness.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "inharness.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The operator pod's selector: stable, no version. */}}
{{- define "inharness.selectorLabels" -}}
app.kubernetes.io/name: {{ include "inharness.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* Labels of every object of the release; the operator's own objects add component=operator. */}}
{{- define "inharness.commonLabels" -}}
app.kubernetes.io/name: {{ include "inharness.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/part-of: inharness
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end -}}

{{- define "inharness.labels" -}}
{{ include "inharness.commonLabels" . }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "inharness.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "inharness.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "inharness.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/*
The namespaces the operator watches, as a JSON list; empty means all of them. A namespaced install
without watchNamespaces watches the release namespace.
*/}}
{{- define "inharness.watchNamespaces" -}}
{{- if .Values.watchNamespaces -}}
{{- toJson .Values.watchNamespaces -}}
{{- else if .Values.rbac.namespaced -}}
{{- toJson (list .Release.Namespace) -}}
{{- else -}}
[]
{{- end -}}
{{- end -}}

{{/* Where the NetworkPolicies go: networkPolicy.namespaces, else the watched ones, else the release namespace. */}}
{{- define "inharness.networkPolicyNamespaces" -}}
{{- $watched := include "inharness.watchNamespaces" . | fromJsonArray -}}
{{- if .Values.networkPolicy.namespaces -}}
{{- toJson .Values.networkPolicy.namespaces -}}
{{- else if $watched -}}
{{- toJson $watched -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* Restricted pod security (Pod Security Standards "restricted"), uid/gid 1000 like the images. */}}
{{- define "inharness.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 1000
runAsGroup: 1000
fsGroup: 1000
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "inharness.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{/* The bundled PostgreSQL pod's selector (postgresql.enabled). */}}
{{- define "inharness.postgresqlSelectorLabels" -}}
app.kubernetes.io/name: {{ include "inharness.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: postgresql
{{- end -}}
