#!/usr/bin/env bash
# Builds gpupool's operator and device-plugin images from the Dockerfile with
# no registry and no Docker engine, and writes each as a docker-archive tarball
# that `ctr images import` (containerd) loads. Prints the output directory (the
# only line on stdout).
#
# The route, and why: buildah (Debian's package, daemonless) builds the
# Dockerfile's `operator` and `device-plugin` targets. No registry is reachable,
# so the base images are made here: one Debian bookworm minbase root made by
# mmdebstrap from Debian's packages stands in for debian:bookworm-slim and for
# distroless/cc (both are glibc Debian 12; the operator still runs as uid
# 65532). The binaries come in through the Dockerfile's `prebuilt` stage,
# already built by cargo (debug by default: what the tests build anyway),
# with their debug sections stripped to keep the archives small.
#
# Besides the two gpupool images it writes:
#   gpupool-pause.tar     the pod sandbox image containerd is pointed at;
#   gpupool-workload.tar  a Debian image with a shell, for test pods.
#
# Usage: IMAGES="$(bash .ci/build-images.sh)"
# Env:   GPUPOOL_IMAGE_PROFILE  cargo profile directory (debug|release)
#        GPUPOOL_IMAGES_DIR     output directory (default .tools/images)
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
profile="${GPUPOOL_IMAGE_PROFILE:-debug}"
out="${GPUPOOL_IMAGES_DIR:-$root/.tools/images}"
bin_dir="$root/target/$profile"
version="$(awk -F'"' '/^appVersion:/ { print $2 }' "$root/charts/gpupool/Chart.yaml")"

# Image references: the chart's defaults, so `helm install` needs no image values.
readonly OPERATOR_IMAGE="ghcr.io/gpupool/gpupool-operator:$version"
readonly DEVICE_PLUGIN_IMAGE="ghcr.io/gpupool/gpupool-device-plugin:$version"
readonly BASE_IMAGE="localhost/gpupool-base:bookworm"
readonly PAUSE_IMAGE="localhost/gpupool-pause:bookworm"
readonly WORKLOAD_IMAGE="localhost/gpupool-workload:bookworm"

# buildah keeps its own store; vfs works on every filesystem (overlay does
# not nest inside every container), at the cost of full copies.
export STORAGE_DRIVER=vfs

die() {
    echo "build-images: $*" >&2
    exit 1
}

[ -n "$version" ] || die "no appVersion in charts/gpupool/Chart.yaml"
for b in gpupool-operator gpupool-device-plugin kubectl-gpupool; do
    [ -x "$bin_dir/$b" ] || die "$bin_dir/$b is missing: run 'cargo build --workspace --bins' first (or set GPUPOOL_IMAGE_PROFILE)"
done

missing=()
for tool in buildah mmdebstrap objcopy; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ "${#missing[@]}" -gt 0 ]; then
    echo "build-images: installing Debian's buildah, mmdebstrap and binutils (missing: ${missing[*]})" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends buildah mmdebstrap binutils ca-certificates >&2
fi

mkdir -p "$out"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

# The base root, made once and kept: it changes only with Debian's packages.
base_tar="$out/base-bookworm.rootfs.tar"
if [ ! -s "$base_tar" ]; then
    echo "build-images: making the Debian bookworm base with mmdebstrap" >&2
    mmdebstrap --quiet --variant=minbase --include=ca-certificates --mode=root \
        --format=tar bookworm "$base_tar.tmp" http://deb.debian.org/debian >&2
    mv "$base_tar.tmp" "$base_tar"
fi

# An image from the base root, re-made when the root is newer than the image.
image_exists() {
    buildah inspect --type image "$1" >/dev/null 2>&1
}
if ! image_exists "$BASE_IMAGE" || [ "$base_tar" -nt "$out/.base-imported" ]; then
    c="$(buildah from scratch)"
    buildah add "$c" "$base_tar" / >/dev/null
    buildah config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$c"
    buildah commit --quiet --rm "$c" "$BASE_IMAGE" >/dev/null
    touch "$out/.base-imported"
fi

# The pod sandbox: sleeps until killed (containerd stops sandboxes with SIGKILL).
c="$(buildah from --pull=never "$BASE_IMAGE")"
buildah config --cmd "" "$c"
buildah config --entrypoint '["/bin/sleep", "infinity"]' "$c"
buildah commit --quiet --rm "$c" "$PAUSE_IMAGE" >/dev/null
buildah tag "$BASE_IMAGE" "$WORKLOAD_IMAGE"

# The context holds only prebuilt/: the Dockerfile's `prebuilt` stage reads it.
mkdir -p "$work/context/prebuilt"
for b in gpupool-operator gpupool-device-plugin kubectl-gpupool; do
    objcopy --strip-debug "$bin_dir/$b" "$work/context/prebuilt/$b"
done
build_target() {
    local target="$1" tag="$2"
    buildah bud --quiet --pull=never --layers=false \
        --file "$root/Dockerfile" --target "$target" \
        --build-arg BINARIES=prebuilt \
        --build-arg DEVICE_PLUGIN_BASE="$BASE_IMAGE" \
        --build-arg OPERATOR_BASE="$BASE_IMAGE" \
        --tag "$tag" "$work/context" >/dev/null
}
build_target operator "$OPERATOR_IMAGE"
build_target device-plugin "$DEVICE_PLUGIN_IMAGE"

write_archive() {
    local image="$1" file="$2"
    rm -f "$out/$file.tmp"
    buildah push --quiet "$image" "docker-archive:$out/$file.tmp:$image" >/dev/null
    mv "$out/$file.tmp" "$out/$file"
}
write_archive "$OPERATOR_IMAGE" gpupool-operator.tar
write_archive "$DEVICE_PLUGIN_IMAGE" gpupool-device-plugin.tar
write_archive "$PAUSE_IMAGE" gpupool-pause.tar
write_archive "$WORKLOAD_IMAGE" gpupool-workload.tar

# Each build leaves the previous images untagged; drop them, so a machine
# that builds often keeps one copy.
buildah rmi --prune >/dev/null 2>&1 || true

echo "$out"
