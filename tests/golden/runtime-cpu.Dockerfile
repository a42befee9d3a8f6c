FROM inferkiln/base:bookworm-py311-958e15ab
RUN groupadd --gid 65532 nim \
 && useradd --uid 65532 --gid 65532 --home-dir /opt/nim --no-create-home --shell /usr/sbin/nologin nim \
 && mkdir -p /opt/nim/.cache /opt/nim/etc/default /opt/nim/model \
 && chown 65532:65532 /opt/nim/.cache
COPY requirements.lock /tmp/requirements.lock
ARG WHEELS
RUN python3 -m venv /opt/nim/venv \
 && python3 -c 'import sys, urllib.request; urllib.request.urlretrieve(sys.argv[1].rstrip("/") + "/uv", "/tmp/uv")' "$WHEELS" \
 && chmod 0755 /tmp/uv \
 && UV_CACHE_DIR=/tmp/uv-cache /tmp/uv pip install --quiet --python /opt/nim/venv/bin/python --no-index --no-deps \
      --require-hashes --compile-bytecode --link-mode hardlink --find-links "$WHEELS" -r /tmp/requirements.lock \
 && rm -rf /tmp/uv /tmp/uv-cache \
 && rm /tmp/requirements.lock
COPY bin/ /usr/local/bin/
COPY service/ /opt/nim/app/service/
RUN INFERKILN_KERNEL_DIR=/opt/nim/lib/kernels PYTHONPATH=/opt/nim/app /opt/nim/venv/bin/python -m service.engine.cpu_gemm
ENV PATH="/opt/nim/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV PYTHONPATH="/opt/nim/app"
ENV HOME="/opt/nim"
ENV NIM_CACHE_PATH="/opt/nim/.cache"
ENV NIM_MANIFEST_PATH="/opt/nim/etc/default/model_manifest.yaml"
ENV NIM_SERVER_PORT="8000"
ENV PYTHONUNBUFFERED="1"
ENV HF_HUB_OFFLINE="0"
ENV INFERKILN_KERNEL_DIR="/opt/nim/lib/kernels"
USER 65532:65532
WORKDIR /opt/nim
EXPOSE 8000
ENTRYPOINT ["nim-serve"]
