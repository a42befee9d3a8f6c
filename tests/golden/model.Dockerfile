FROM inferkiln/runtime-cpu:0123456789ab
COPY model_manifest.yaml /opt/nim/etc/default/model_manifest.yaml
COPY model/ /opt/nim/model/
ENV NIM_SERVED_MODEL_NAME="tiny-llama"
ENV NIM_TOOL_CALL_PARSER="hermes"
LABEL "org.opencontainers.image.title"="tiny-llama"
