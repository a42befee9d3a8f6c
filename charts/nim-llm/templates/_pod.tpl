{{/*
The pod spec shared by the Deployment, the StatefulSet and the LeaderWorkerSet.
Usage: {{ include "nim-llm.podSpec" . | nindent 6 }}
*/}}
{{- define "nim-llm.podSpec" -}}
serviceAccountName: {{ include "nim-llm.serviceAccountName" . }}
automountServiceAccountToken: {{ .Values.serviceAccount.automount }}
{{- with .Values.runtimeClassName }}
runtimeClassName: {{ . }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- if .Values.modelStore.initContainer }}
initContainers:
  - name: download-to-cache
    image: {{ include "nim-llm.image" . | quote }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    command: ["download-to-cache"]
    securityContext:
      {{- toYaml .Values.containerSecurityContext | nindent 6 }}
    env:
      {{- include "nim-llm.env" . | nindent 6 }}
    resources:
      {{- toYaml .Values.resources | nindent 6 }}
    volumeMounts:
      {{- include "nim-llm.volumeMounts" . | nindent 6 }}
{{- end }}
containers:
  - name: nim-llm
    image: {{ include "nim-llm.image" . | quote }}
    imagePullPolicy: {{ .Values.image.pullPolicy }}
    securityContext:
      {{- toYaml .Values.containerSecurityContext | nindent 6 }}
    env:
      {{- include "nim-llm.env" . | nindent 6 }}
    ports:
      - name: http
        containerPort: {{ .Values.model.openaiPort }}
        protocol: TCP
    startupProbe:
      {{- toYaml .Values.startupProbe | nindent 6 }}
    livenessProbe:
      {{- toYaml .Values.livenessProbe | nindent 6 }}
    readinessProbe:
      {{- toYaml .Values.readinessProbe | nindent 6 }}
    resources:
      {{- toYaml .Values.resources | nindent 6 }}
    volumeMounts:
      {{- include "nim-llm.volumeMounts" . | nindent 6 }}
volumes:
  {{- if not (and .Values.statefulSet.enabled .Values.persistence.enabled (not .Values.persistence.existingClaim)) }}
  - name: model-cache
    {{- if .Values.persistence.enabled }}
    persistentVolumeClaim:
      claimName: {{ .Values.persistence.existingClaim | default (include "nim-llm.fullname" .) }}
    {{- else if .Values.ephemeralVolume.enabled }}
    ephemeral:
      volumeClaimTemplate:
        metadata:
          labels:
            {{- include "nim-llm.selectorLabels" . | nindent 12 }}
        spec:
          accessModes: [ReadWriteOnce]
          {{- with .Values.ephemeralVolume.storageClass }}
          storageClassName: {{ . }}
          {{- end }}
          resources:
            requests:
              storage: {{ .Values.ephemeralVolume.size }}
    {{- else if .Values.hostPath }}
    hostPath:
      path: {{ .Values.hostPath }}
      type: DirectoryOrCreate
    {{- else if .Values.nfs.enabled }}
    nfs:
      server: {{ required "nfs.server is required" .Values.nfs.server }}
      path: {{ required "nfs.path is required" .Values.nfs.path }}
      readOnly: {{ .Values.nfs.readOnly }}
    {{- else }}
    emptyDir: {}
    {{- end }}
  {{- end }}
  - {name: tmp, emptyDir: {}}
  - name: dshm
    emptyDir:
      medium: Memory
      {{- with .Values.shmSize }}
      sizeLimit: {{ . }}
      {{- end }}
  {{- if .Values.modelStore.imageVolume }}
  - name: model-artifact
    image:
      reference: {{ required "modelStore.imageVolume needs modelStore.source (oci://REGISTRY/REPO@sha256:...)" .Values.modelStore.source | trimPrefix "oci://" | quote }}
      pullPolicy: IfNotPresent
  {{- end }}
  {{- with .Values.modelStore.verifyKey }}
  {{- if .secretName }}
  - name: model-verify-key
    secret: {secretName: {{ .secretName | quote }}, items: [{key: {{ .key | quote }}, path: {{ .key | quote }}}]}
  {{- else if .configMapName }}
  - name: model-verify-key
    configMap: {name: {{ .configMapName | quote }}, items: [{key: {{ .key | quote }}, path: {{ .key | quote }}}]}
  {{- end }}
  {{- end }}
  {{- if .Values.adapters.claimName }}
  - name: lora-adapters
    persistentVolumeClaim: {claimName: {{ .Values.adapters.claimName | quote }}, readOnly: true}
  {{- end }}
  {{- with .Values.extraVolumes }}
  {{- toYaml . | nindent 2 }}
  {{- end }}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- $gpu := and .Values.resources .Values.resources.limits (hasKey .Values.resources.limits "nvidia.com/gpu") }}
{{- $tolerations := .Values.tolerations | default list }}
{{- if $gpu }}
  {{- $given := false }}
  {{- range $tolerations }}{{ if eq (.key | default "") "nvidia.com/gpu" }}{{ $given = true }}{{ end }}{{ end }}
  {{- if not $given }}
  {{- $tolerations = append $tolerations (dict "key" "nvidia.com/gpu" "operator" "Exists" "effect" "NoSchedule") }}
  {{- end }}
{{- end }}
{{- with $tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
Pod template metadata.
Usage: {{ include "nim-llm.podMetadata" . | nindent 4 }}
*/}}
{{- define "nim-llm.podMetadata" -}}
labels:
  {{- include "nim-llm.labels" . | nindent 2 }}
{{- if .Values.metrics.enabled }}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/path: /v1/metrics
  prometheus.io/port: {{ .Values.model.openaiPort | quote }}
{{- end }}
{{- end }}

{{/*
The environment of the server and of the init container that fills its cache.
*/}}
{{- define "nim-llm.env" -}}
- {name: NIM_CACHE_PATH, value: {{ .Values.model.nimCache | quote }}}
- {name: NIM_SERVER_PORT, value: {{ .Values.model.openaiPort | quote }}}
- {name: NIM_JSONL_LOGGING, value: {{ ternary "1" "0" .Values.model.jsonLogging | quote }}}
- {name: NIM_LOG_LEVEL, value: {{ .Values.model.logLevel | quote }}}
{{- with .Values.model.name }}
- {name: NIM_SERVED_MODEL_NAME, value: {{ . | quote }}}
{{- end }}
{{- with .Values.model.profile }}
- {name: NIM_MODEL_PROFILE, value: {{ . | quote }}}
{{- end }}
{{- with .Values.modelStore.source }}
- {name: NIM_MODEL_PATH, value: {{ . | quote }}}
{{- end }}
{{- if .Values.modelStore.imageVolume }}
- {name: NIM_MODEL_MOUNT, value: /opt/nim/model-artifact}
{{- end }}
{{- if not .Values.modelStore.verify }}
- {name: NIM_MODEL_VERIFY, value: "0"}
{{- end }}
{{- if or .Values.modelStore.verifyKey.secretName .Values.modelStore.verifyKey.configMapName }}
- {name: NIM_MODEL_VERIFY_KEY, value: {{ printf "/etc/nim/model-verify-key/%s" .Values.modelStore.verifyKey.key | quote }}}
{{- end }}
{{- if .Values.adapters.claimName }}
- {name: NIM_PEFT_SOURCE, value: /opt/nim/loras}
{{- end }}
{{- if .Values.adapters.refreshInterval }}
- {name: NIM_PEFT_REFRESH_INTERVAL, value: {{ .Values.adapters.refreshInterval | quote }}}
{{- end }}
{{- with .Values.env }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end }}

{{/*
The volumes the server and the init container mount.
*/}}
{{- define "nim-llm.volumeMounts" -}}
- {name: model-cache, mountPath: {{ .Values.model.nimCache | quote }}}
- {name: tmp, mountPath: /tmp}
- {name: dshm, mountPath: /dev/shm}
{{- if or .Values.modelStore.verifyKey.secretName .Values.modelStore.verifyKey.configMapName }}
- {name: model-verify-key, mountPath: /etc/nim/model-verify-key, readOnly: true}
{{- end }}
{{- if .Values.modelStore.imageVolume }}
- {name: model-artifact, mountPath: /opt/nim/model-artifact, readOnly: true}
{{- end }}
{{- if .Values.adapters.claimName }}
- {name: lora-adapters, mountPath: /opt/nim/loras, readOnly: true}
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end }}
