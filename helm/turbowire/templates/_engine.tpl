{{/*
One engine role's Deployment: "turbowire.engine" with (list $ "prefill") or (list $ "decode").
*/}}
{{- define "turbowire.engine" -}}
{{- $root := index . 0 -}}
{{- $role := index . 1 -}}
{{- $v := $root.Values -}}
{{- $e := index $v $role -}}
{{- $fullname := include "turbowire.fullname" $root -}}
{{- $lease := int (default 30 (index $v.turbowire.extraConfig "lease_seconds")) -}}
{{- if and (eq $role "prefill") (lt (int $e.drainSeconds) $lease) -}}
{{- fail (printf "%s.drainSeconds (%d) must be at least the lease (turbowire.extraConfig.lease_seconds = %d): a stopping prefill engine keeps serving its leases that long" $role (int $e.drainSeconds) $lease) -}}
{{- end -}}
{{- if le (int $e.terminationGracePeriodSeconds) (int $e.drainSeconds) -}}
{{- fail (printf "%s.terminationGracePeriodSeconds (%d) must be longer than %s.drainSeconds (%d), or the kubelet kills the engine while it drains" $role (int $e.terminationGracePeriodSeconds) $role (int $e.drainSeconds)) -}}
{{- end -}}
{{- $resources := default $v.resources $e.resources -}}
{{- $ucxPorts := $v.ucx.tcpPortRange -}}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $fullname }}-{{ $role }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "turbowire.labels" $root | nindent 4 }}
    app.kubernetes.io/component: {{ $role }}
spec:
  replicas: {{ $e.replicas }}
  revisionHistoryLimit: 3
  strategy:
    {{- toYaml $e.strategy | nindent 4 }}
  selector:
    matchLabels:
      {{- include "turbowire.selectorLabels" $root | nindent 6 }}
      app.kubernetes.io/component: {{ $role }}
  template:
    metadata:
      labels:
        {{- include "turbowire.selectorLabels" $root | nindent 8 }}
        app.kubernetes.io/component: {{ $role }}
        {{- with $e.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      annotations:
        checksum/auth: {{ include (print $root.Template.BasePath "/secret.yaml") $root | sha256sum }}
        {{- with $e.podAnnotations }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "turbowire.serviceAccountName" $root }}
      automountServiceAccountToken: false
      terminationGracePeriodSeconds: {{ $e.terminationGracePeriodSeconds }}
      {{- with $v.image.pullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $e.runtimeClassName }}
      runtimeClassName: {{ . }}
      {{- end }}
      {{- if $e.hostIPC }}
      hostIPC: true
      {{- end }}
      {{- with $e.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      securityContext:
        {{- toYaml $v.podSecurityContext | nindent 8 }}
      {{- with $e.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $e.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $e.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: vllm
          image: {{ include "turbowire.image" $root }}
          imagePullPolicy: {{ $v.image.pullPolicy }}
          command: ["python3", "-m", "vllm.entrypoints.openai.api_server"]
          args:
            - --model
            - {{ $v.model.name | quote }}
            {{- with $v.model.servedModelName }}
            - --served-model-name
            - {{ . | quote }}
            {{- end }}
            - --host
            - "0.0.0.0"
            - --port
            - {{ $e.port | quote }}
            - --kv-transfer-config
            - {{ include "turbowire.kvTransferConfig" (list $root $role) | toJson }}
            # refuse transfer params smuggled in vllm_xargs (400, not a 500 or a dead engine)
            - --middleware
            - turbowire.connector.http_guard.TransferParamsGuard
            {{- range $v.model.extraArgs }}
            - {{ . | quote }}
            {{- end }}
            {{- range $e.extraArgs }}
            - {{ . | quote }}
            {{- end }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: TURBOWIRE_AUTH_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ include "turbowire.authSecretName" $root }}
                  key: {{ $v.turbowire.authToken.secretKey }}
            {{- include "turbowire.storePasswordEnv" $root | nindent 12 }}
            {{- with $v.model.hfTokenSecret.name }}
            - name: HF_TOKEN
              valueFrom:
                secretKeyRef:
                  name: {{ . }}
                  key: {{ $v.model.hfTokenSecret.key }}
            {{- end }}
            - name: HOME
              value: /tmp
            - name: HF_HOME
              value: /cache/huggingface
            - name: VLLM_NO_USAGE_STATS
              value: "1"
            {{- if $ucxPorts.enabled }}
            - name: UCX_TCP_PORT_RANGE
              value: "{{ int $ucxPorts.start }}-{{ int $ucxPorts.end }}"
            {{- end }}
            {{- range $name, $value := $v.ucx.env }}
            - name: {{ $name }}
              value: {{ $value | toString | quote }}
            {{- end }}
            {{- with $e.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          ports:
            - name: http
              containerPort: {{ $e.port }}
              protocol: TCP
            - name: side-channel
              containerPort: {{ $v.turbowire.sideChannelPort }}
              protocol: TCP
          startupProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: {{ $e.probes.startup.periodSeconds }}
            failureThreshold: {{ $e.probes.startup.failureThreshold }}
            timeoutSeconds: 5
          readinessProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: {{ $e.probes.readiness.periodSeconds }}
            failureThreshold: {{ $e.probes.readiness.failureThreshold }}
            timeoutSeconds: 5
          livenessProbe:
            httpGet:
              path: /health
              port: http
            periodSeconds: {{ $e.probes.liveness.periodSeconds }}
            failureThreshold: {{ $e.probes.liveness.failureThreshold }}
            timeoutSeconds: 10
          lifecycle:
            preStop:
              exec:
                # Leave the Service first, then keep serving leases (and in-flight decodes) for
                # drainSeconds before vLLM gets SIGTERM.
                command: ["sleep", "{{ int $e.drainSeconds }}"]
          resources:
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- toYaml $e.securityContext | nindent 12 }}
          volumeMounts:
            - name: dshm
              mountPath: /dev/shm
            - name: tmp
              mountPath: /tmp
            - name: cache
              mountPath: /cache
            {{- if include "turbowire.sideChannelTls" $root }}
            - name: side-channel-tls
              mountPath: {{ include "turbowire.sideChannelTlsDir" $root }}
              readOnly: true
            {{- end }}
            {{- with $e.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
      volumes:
        - name: dshm
          emptyDir:
            medium: Memory
            sizeLimit: {{ $e.shmSize }}
        - name: tmp
          emptyDir: {}
        - name: cache
          {{- if $v.model.cache.existingClaim }}
          persistentVolumeClaim:
            claimName: {{ $v.model.cache.existingClaim }}
          {{- else }}
          emptyDir:
            sizeLimit: {{ $v.model.cache.sizeLimit }}
          {{- end }}
        {{- if include "turbowire.sideChannelTls" $root }}
        {{- include "turbowire.sideChannelTlsVolume" $root | nindent 8 }}
        {{- end }}
        {{- with $e.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
{{- end -}}
