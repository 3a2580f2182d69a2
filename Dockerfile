# syntax=docker/dockerfile:1.7
#
# Both gpupool images from one build of the workspace, with the locked
# dependencies:
#
#   docker build --target operator      -t ghcr.io/gpupool/gpupool-operator:0.1.0 .
#   docker build --target device-plugin -t ghcr.io/gpupool/gpupool-device-plugin:0.1.0 .
#
# (The tags are the workspace version, which is the chart's appVersion and so
# its default image tag; kind users load them with `kind load docker-image`.)
#
# Build arguments, each defaulting to the path above, so a machine with no
# registry can build the same images (`.ci/build-images.sh` does, with
# buildah):
#   BUILD_IMAGE, DEVICE_PLUGIN_BASE, OPERATOR_BASE  the three base images;
#   BINARIES  the stage the binaries come from: `build` compiles them here;
#             `prebuilt` takes them from the context's `prebuilt/` folder
#             (a context holding only that folder is enough).

ARG RUST_VERSION=1.95.0
ARG BUILD_IMAGE=rust:${RUST_VERSION}-slim-bookworm
ARG DEVICE_PLUGIN_BASE=debian:bookworm-slim
ARG OPERATOR_BASE=gcr.io/distroless/cc-debian12:nonroot
ARG BINARIES=build

# ---------------------------------------------------------------------------
# Build: Debian bookworm, so the binaries' glibc matches both runtime images.
FROM ${BUILD_IMAGE} AS build
WORKDIR /src
COPY . .
# The registry and target caches make rebuilds incremental; the binaries are
# copied out because cache mounts are not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p gpupool-operator -p gpupool-device-plugin -p kubectl-gpupool \
    && mkdir -p /out \
    && cp target/release/gpupool-operator target/release/gpupool-device-plugin \
          target/release/kubectl-gpupool /out/

# Binaries built elsewhere, for the same glibc (Debian bookworm): the files
# gpupool-operator, gpupool-device-plugin and kubectl-gpupool in prebuilt/.
FROM scratch AS prebuilt
COPY prebuilt/gpupool-operator prebuilt/gpupool-device-plugin prebuilt/kubectl-gpupool /out/

# Whichever of the two the BINARIES argument names.
FROM ${BINARIES} AS binaries

# ---------------------------------------------------------------------------
# Device plugin: runs as root, because it creates its socket in the kubelet's
# root-owned <kubelet-dir>/device-plugins/ directory and connects to
# kubelet.sock and the PodResources socket (the chart drops every capability;
# plain uid 0 owns those files). debian-slim rather than distroless because
# the NVIDIA container toolkit runs the image's ldconfig when it injects the
# driver's NVML library for `--discovery nvml|auto`.
FROM ${DEVICE_PLUGIN_BASE} AS device-plugin
LABEL org.opencontainers.image.title="gpupool-device-plugin" \
      org.opencontainers.image.description="gpupool's kubelet device plugin: every GPU as gpupool/slot slots" \
      org.opencontainers.image.source="https://github.com/gpupool/gpupool" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=binaries /out/gpupool-device-plugin /usr/local/bin/gpupool-device-plugin
USER 0:0
EXPOSE 8081
ENTRYPOINT ["/usr/local/bin/gpupool-device-plugin"]

# ---------------------------------------------------------------------------
# Operator: distroless (glibc and libgcc only, no shell), non-root 65532 — the
# uid the chart's runAsUser names.
FROM ${OPERATOR_BASE} AS operator
LABEL org.opencontainers.image.title="gpupool-operator" \
      org.opencontainers.image.description="gpupool's operator: FIFO admission of pods to GPU slots, helpers, preemption, lease snapshots" \
      org.opencontainers.image.source="https://github.com/gpupool/gpupool" \
      org.opencontainers.image.licenses="Apache-2.0"
COPY --from=binaries /out/gpupool-operator /usr/local/bin/gpupool-operator
# The kubectl plugin ships beside it, so an operator pod can be asked about
# the queue with `kubectl exec … -- kubectl-gpupool queue` using its own
# (read-only for leases) service account.
COPY --from=binaries /out/kubectl-gpupool /usr/local/bin/kubectl-gpupool
USER 65532:65532
EXPOSE 9443 8080
ENTRYPOINT ["/usr/local/bin/gpupool-operator"]
