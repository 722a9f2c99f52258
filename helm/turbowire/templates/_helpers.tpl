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

{{/* Where the side channel's TLS files are mounted (turbowire.sideChannel.tls). */}}
{{- define "turbowire.sideChannelTlsDir" -}}/etc/turbowire/side-channel-tls{{- end -}}

{{/*
"true" when turbowire.sideChannel.tls is on (and its source is valid: exactly one of secretName
and volume), else "".
*/}}
{{- define "turbowire.sideChannelTls" -}}
{{- $sc := .Values.turbowire.sideChannel | default dict -}}
{{- $tls := $sc.tls | default dict -}}
{{- if $tls.enabled -}}
{{- if and $tls.secretName $tls.volume -}}
{{- fail "turbowire.sideChannel.tls: set secretName (a kubernetes.io/tls Secret) or volume (e.g. a cert-manager csi-driver volume), not both" -}}
{{- end -}}
{{- if not (or $tls.secretName $tls.volume) -}}
{{- fail "turbowire.sideChannel.tls.enabled needs turbowire.sideChannel.tls.secretName (a kubernetes.io/tls Secret with tls.crt and tls.key, the CA in caKey of caSecretName or of the same Secret) or turbowire.sideChannel.tls.volume" -}}
{{- end -}}
{{- if and $tls.caSecretName (not $tls.secretName) -}}
{{- fail "turbowire.sideChannel.tls.caSecretName goes with secretName; a volume provides ca.crt itself" -}}
{{- end -}}
true
{{- end -}}
{{- end -}}

{{/* The pod volume of the side channel's TLS files (mounted read-only by the engines). */}}
{{- define "turbowire.sideChannelTlsVolume" -}}
{{- $tls := .Values.turbowire.sideChannel.tls -}}
- name: side-channel-tls
{{- if $tls.volume }}
  {{- toYaml $tls.volume | nindent 2 }}
{{- else }}
  projected:
    defaultMode: 0440
    sources:
      - secret:
          name: {{ $tls.secretName }}
          items:
            - key: tls.crt
              path: tls.crt
            - key: tls.key
              path: tls.key
      - secret:
          name: {{ default $tls.secretName $tls.caSecretName }}
          items:
            - key: {{ $tls.caKey | default "ca.crt" }}
              path: ca.crt
{{- end }}
{{- end -}}

{{/* The Redis of the store path: the one deployed here (its Service) or redis.url; "" if none. */}}
{{- define "turbowire.redisUrl" -}}
{{- if and .Values.redis.enabled .Values.redis.url -}}
{{- fail "redis.enabled and redis.url exclude each other: deploy Redis here (enabled) or point at one (url)" -}}
{{- end -}}
{{- if .Values.redis.enabled -}}
{{- printf "redis://%s-redis:%d" (include "turbowire.fullname" .) (int .Values.redis.port) -}}
{{- else -}}
{{- .Values.redis.url -}}
{{- end -}}
{{- end -}}

{{/*
The Secret holding the store's Redis password (key `password`); "" when the clients get none:
redis.auth.enabled off, or an external redis.url without redis.auth.existingSecret.
*/}}
{{- define "turbowire.redisAuthSecretName" -}}
{{- $auth := .Values.redis.auth | default dict -}}
{{- if $auth.enabled -}}
{{- if $auth.existingSecret -}}
{{- $auth.existingSecret -}}
{{- else if .Values.redis.enabled -}}
{{- printf "%s-redis-auth" (include "turbowire.fullname" .) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The env entry of the store's password (engines and proxy, transport store/both), if any. */}}
{{- define "turbowire.storePasswordEnv" -}}
{{- $secret := include "turbowire.redisAuthSecretName" . -}}
{{- if and (include "turbowire.usesStore" .) $secret }}
- name: TURBOWIRE_STORE_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $secret }}
      key: password
{{- end }}
{{- end -}}

{{/* "true" when turbowire.transport uses the store (store or both), else "". */}}
{{- define "turbowire.usesStore" -}}
{{- if has .Values.turbowire.transport (list "store" "both") -}}true{{- end -}}
{{- end -}}

{{/* The store_url of store/both: the Redis above; rendering fails without one. */}}
{{- define "turbowire.storeUrl" -}}
{{- $url := include "turbowire.redisUrl" . -}}
{{- if not $url -}}
{{- fail (printf "turbowire.transport=%s needs a Redis for the store: set redis.enabled=true (deploy one here) or redis.url=redis://HOST:PORT (an external one)" .Values.turbowire.transport) -}}
{{- end -}}
{{- $url -}}
{{- end -}}

{{/* store_namespace: turbowire.store.namespace, else the release name. */}}
{{- define "turbowire.storeNamespace" -}}
{{- $store := .Values.turbowire.store | default dict -}}
{{- default .Release.Name $store.namespace -}}
{{- end -}}

{{/* The directory the proxy reads (store/both): extraConfig.directory_url, else the store URL. */}}
{{- define "turbowire.directoryUrl" -}}
{{- default (include "turbowire.storeUrl" .) (index .Values.turbowire.extraConfig "directory_url") -}}
{{- end -}}

{{/*
The --kv-transfer-config of one engine role ("prefill" or "decode"), as JSON. The connector
validates every key of kv_connector_extra_config at start (connector/config.py); the chart renders
only keys it knows: the preset, the side-channel port, the advertised host (the pod IP, expanded by
the kubelet from $(POD_IP)), with transport store/both the store keys (transport, store_url,
store_namespace and the turbowire.store values that are set), the TLS files of
turbowire.sideChannel.tls when it is on, and turbowire.extraConfig. The keys
the chart sets are refused in extraConfig (generate.py RESERVED_KEYS names the same), so no value
silently overrides another. With transport nixl no transport or store key is rendered (the
connector's default is nixl). Decode engines get save_schedule after_forward (they stage nothing
for NIXL, so vLLM keeps its FULL CUDA graphs) unless extraConfig sets it.
*/}}
{{- define "turbowire.kvTransferConfig" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $v := $root.Values -}}
{{- $reserved := dict "preset" "turbowire.preset" "side_channel_port" "turbowire.sideChannelPort" "side_channel_host" "the pod IP (set by the chart)" "auth_token" "turbowire.authToken" "transport" "turbowire.transport" "store_url" "redis.enabled or redis.url" "store_namespace" "turbowire.store.namespace" "store_local_cpu_bytes" "turbowire.store.localCpuBytes" "store_local_disk" "turbowire.store.localDisk" "store_ttl_seconds" "turbowire.store.ttlSeconds" "store_chunk_tokens" "turbowire.store.chunkTokens" "side_channel_tls_cert" "turbowire.sideChannel.tls" "side_channel_tls_key" "turbowire.sideChannel.tls" "side_channel_tls_ca" "turbowire.sideChannel.tls" -}}
{{- range $k, $_ := $v.turbowire.extraConfig -}}
{{- if hasKey $reserved $k -}}
{{- fail (printf "turbowire.extraConfig.%s: set it through its own value (%s), not extraConfig" $k (index $reserved $k)) -}}
{{- end -}}
{{- end -}}
{{- $extra := dict "preset" $v.turbowire.preset "side_channel_port" (int $v.turbowire.sideChannelPort) "side_channel_host" "$(POD_IP)" -}}
{{- if include "turbowire.sideChannelTls" $root -}}
{{- $dir := include "turbowire.sideChannelTlsDir" $root -}}
{{- $_ := set $extra "side_channel_tls_cert" (printf "%s/tls.crt" $dir) -}}
{{- $_ = set $extra "side_channel_tls_key" (printf "%s/tls.key" $dir) -}}
{{- $_ = set $extra "side_channel_tls_ca" (printf "%s/ca.crt" $dir) -}}
{{- end -}}
{{- if include "turbowire.usesStore" $root -}}
{{- if eq (toString (index $v.turbowire.extraConfig "load_failure_policy")) "fail" -}}
{{- fail (printf "turbowire.extraConfig.load_failure_policy=fail cannot be used with turbowire.transport=%s: a store miss recomputes, it never fails the request (use recompute, or leave it unset)" $v.turbowire.transport) -}}
{{- end -}}
{{- $store := $v.turbowire.store | default dict -}}
{{- $_ := set $extra "transport" $v.turbowire.transport -}}
{{- $_ = set $extra "store_url" (include "turbowire.storeUrl" $root) -}}
{{- $_ = set $extra "store_namespace" (include "turbowire.storeNamespace" $root) -}}
{{- if not (kindIs "invalid" $store.localCpuBytes) -}}
{{- $_ = set $extra "store_local_cpu_bytes" (ternary $store.localCpuBytes (int64 $store.localCpuBytes) (kindIs "string" $store.localCpuBytes)) -}}
{{- end -}}
{{- with $store.localDisk -}}
{{- $_ = set $extra "store_local_disk" . -}}
{{- end -}}
{{- if not (kindIs "invalid" $store.ttlSeconds) -}}
{{- $_ = set $extra "store_ttl_seconds" $store.ttlSeconds -}}
{{- end -}}
{{- if not (kindIs "invalid" $store.chunkTokens) -}}
{{- $_ = set $extra "store_chunk_tokens" (int64 $store.chunkTokens) -}}
{{- end -}}
{{- end -}}
{{- $extra = merge $extra (deepCopy $v.turbowire.extraConfig) -}}
{{- if and (ne $role "prefill") (not (hasKey $extra "save_schedule")) -}}
{{- /* a decode engine stages nothing for NIXL: keep vLLM's FULL CUDA graphs */ -}}
{{- $_ := set $extra "save_schedule" "after_forward" -}}
{{- end -}}
{{- $kvRole := ternary "kv_producer" "kv_consumer" (eq $role "prefill") -}}
{{- dict "kv_connector" "TurboWireConnector" "kv_connector_module_path" "turbowire.connector" "kv_role" $kvRole "kv_connector_extra_config" $extra | toJson -}}
{{- end -}}
