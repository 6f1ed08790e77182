{{/* The labels every object of a release carries. */}}
{{- define "elasticd.labels" -}}
app.kubernetes.io/name: elasticd
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{/* The etcd StatefulSet's name, and its headless Service's (the members' DNS names). */}}
{{- define "elasticd.etcdName" -}}{{ .Release.Name }}-etcd{{- end -}}
{{- define "elasticd.etcdPeers" -}}{{ .Release.Name }}-etcd-peers{{- end -}}

{{/* etcd_endpoints: every member of the StatefulSet by its DNS name, else the external ones. */}}
{{- define "elasticd.etcdEndpoints" -}}
{{- if .Values.etcd.deploy -}}
{{- $name := include "elasticd.etcdName" . -}}
{{- $peers := include "elasticd.etcdPeers" . -}}
{{- $out := list -}}
{{- range $i := until (int .Values.etcd.members) -}}
{{- $out = append $out (printf "%s-%d.%s:2379" $name $i $peers) -}}
{{- end -}}
{{- join "," $out -}}
{{- else -}}
{{- required "etcd.endpoints: set it when etcd.deploy is false" (join "," .Values.etcd.endpoints) -}}
{{- end -}}
{{- end -}}
