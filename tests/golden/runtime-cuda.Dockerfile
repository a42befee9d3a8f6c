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
 && UV_CACHE_DIR=/tmp/uv-cache /tmp/uv pip install --quiet --python /opt/nim/venv/bin/python --no-index --no-deps \
      --require-hashes --compile-bytecode --link-mode hardlink --find-links "$WHEELS" -r /tmp/requirements.lock --reinstall-package cuda-bindings \
 && rm -rf /tmp/uv /tmp/uv-cache \
 && cd /opt/nim/venv/lib/python3.11/site-packages \
 && rm -rf \
      nvidia/cu13/lib/libnvrtc.alt.so.* \
      nvidia/cu13/lib/libnvrtc-builtins.alt.so.* \
      nvidia/cu13/lib/libcusolverMg.so.* \
      nvidia/cu13/lib/libcufile_rdma.so.* \
      nvidia/nvshmem/lib/nvshmem_transport_ibgda.so.* \
      nvidia/nvshmem/lib/nvshmem_transport_ibdevx.so.* \
      nvidia/nvshmem/lib/nvshmem_transport_libfabric.so.* \
      nvidia/nvshmem/lib/nvshmem_transport_ucx.so.* \
      nvidia/nvshmem/lib/nvshmem_bootstrap_mpi.so.* \
      nvidia/nvshmem/lib/nvshmem_bootstrap_shmem.so.* \
      nvidia/nvshmem/lib/nvshmem_bootstrap_pmix.so.* \
      numba/np/ufunc/tbbpool.*.so \
      triton/backends/nvidia/lib/cupti \
      build_backend.py \
 && ln -s lib nvidia/cu13/lib64 \
 && ln -s libcudart.so.13 nvidia/cu13/lib/libcudart.so \
 && mkdir -p nvidia/cu13/lib/stubs \
 && gcc -shared -Wl,-soname,libcuda.so.1 -o nvidia/cu13/lib/stubs/libcuda.so -x c /dev/null \
 && rm /tmp/requirements.lock
COPY bin/ /usr/local/bin/
COPY service/ /opt/nim/app/service/
RUN VLLM_NO_USAGE_STATS=1 PYTHONPATH=/opt/nim/app /opt/nim/venv/bin/python -m service.engine.vllm_modelinfo \
 && rm -rf /tmp/torchinductor_root
ENV PATH="/opt/nim/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
ENV PYTHONPATH="/opt/nim/app"
ENV HOME="/opt/nim"
ENV NIM_CACHE_PATH="/opt/nim/.cache"
ENV NIM_MANIFEST_PATH="/opt/nim/etc/default/model_manifest.yaml"
ENV NIM_SERVER_PORT="8000"
ENV PYTHONUNBUFFERED="1"
ENV HF_HUB_OFFLINE="0"
ENV NVIDIA_VISIBLE_DEVICES="all"
ENV NVIDIA_DRIVER_CAPABILITIES="compute,utility"
ENV NVIDIA_REQUIRE_CUDA="cuda>=13.0"
ENV CUDA_DEVICE_ORDER="PCI_BUS_ID"
ENV TRITON_CACHE_DIR="/opt/nim/.cache/triton"
ENV CUDA_HOME="/opt/nim/venv/lib/python3.11/site-packages/nvidia/cu13"
USER 65532:65532
WORKDIR /opt/nim
EXPOSE 8000
ENTRYPOINT ["nim-serve"]
