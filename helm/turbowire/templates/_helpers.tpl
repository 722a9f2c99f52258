{{/* Names and labels. */}}
{{- define "turbowire.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "turbowire.fullname" -}}
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

{{- define "turbowire.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Labels every pod of the release carries: the NetworkPolicy admits peers by these. */}}
{{- define "turbowire.selectorLabels" -}}
app.kubernetes.io/name: {{ include "turbowire.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "turbowire.labels" -}}
helm.sh/chart: {{ include "turbowire.chart" . }}
{{ include "turbowire.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: turbowire
{{- end -}}

{{- define "turbowire.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "turbowire.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "turbowire.image" -}}
{{- $tag := default .Chart.AppVersion .Values.image.tag -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{- define "turbowire.authSecretName" -}}
{{- default (printf "%s-auth" (include "turbowire.fullname" .)) .Values.turbowire.authToken.existingSecret -}}
{{- end -}}

{{/* The Redis address for the (future) store directory: the bundled one or redis.url. */}}
{{- define "turbowire.redisUrl" -}}
{{- if and .Values.redis.enabled .Values.redis.url -}}
{{- fail "redis.enabled and redis.url exclude each other: deploy Redis here (enabled) or point at one (url)" -}}
{{- end -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:%d/0" (include "turbowire.fullname" .) (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/*
The --kv-transfer-config of one engine role ("prefill" or "decode"), as JSON. The connector
validates every key of kv_connector_extra_config at start (connector/config.py); the chart renders
only keys it knows: the preset, the side-channel port, the advertised host (the pod IP, expanded by
the kubelet from $(POD_IP)) and turbowire.extraConfig. turbowire.transport is not a connector key
(only NIXL exists today) and is not rendered.
*/}}
{{- define "turbowire.kvTransferConfig" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $v := $root.Values -}}
{{- $reserved := list "preset" "side_channel_port" "side_channel_host" "auth_token" "transport" -}}
{{- range $k, $_ := $v.turbowire.extraConfig -}}
{{- if has $k $reserved -}}
{{- fail (printf "turbowire.extraConfig.%s: set it through its own value (turbowire.preset, turbowire.sideChannelPort, turbowire.authToken), not extraConfig" $k) -}}
{{- end -}}
{{- end -}}
{{- $extra := dict "preset" $v.turbowire.preset "side_channel_port" (int $v.turbowire.sideChannelPort) "side_channel_host" "$(POD_IP)" -}}
{{- $extra = merge $extra (deepCopy $v.turbowire.extraConfig) -}}
{{- $kvRole := ternary "kv_producer" "kv_consumer" (eq $role "prefill") -}}
{{- dict "kv_connector" "TurboWireConnector" "kv_connector_module_path" "turbowire.connector" "kv_role" $kvRole "kv_connector_extra_config" $extra | toJson -}}
{{- end -}}
