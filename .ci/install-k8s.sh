#!/usr/bin/env bash
# Prepares a real Kubernetes control plane and real nodes for the tests, in
# the envtest layout: one directory (printed as the only line on stdout)
# holding kube-apiserver, kube-scheduler, kube-controller-manager, etcd and
# the kubelet. Point KUBEBUILDER_ASSETS at it.
#
# The Kubernetes binaries come xz-compressed from ../shared/k8s (no registry
# ships them; see its README for provenance) and are checked against its
# SHA256SUMS; etcd is Debian's `etcd-server` package, and what real nodes
# need besides the kubelet (containerd, runc, the CNI plugins, iptables) are
# Debian's packages too, each installed when missing.
# Idempotent: binaries already unpacked with the right checksum are kept.
#
# Usage: KUBEBUILDER_ASSETS="$(bash .ci/install-k8s.sh)"
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
src="${GPUPOOL_K8S_SOURCE:-$root/../shared/k8s}"
dir="$root/.tools/k8s"
binaries=(kube-apiserver kube-scheduler kube-controller-manager kubelet)

die() {
    echo "install-k8s: $*" >&2
    exit 1
}

[ -f "$src/SHA256SUMS" ] || die "no $src/SHA256SUMS (the compressed Kubernetes binaries are expected there)"

# The checksum of one executable as SHA256SUMS pins it.
pinned() {
    awk -v f="$1" '$2 == f { print $1 }' "$src/SHA256SUMS"
}

mkdir -p "$dir"
for b in "${binaries[@]}"; do
    want="$(pinned "$b")"
    [ -n "$want" ] || die "SHA256SUMS names no checksum for $b"
    if [ -x "$dir/$b" ] && [ "$(sha256sum "$dir/$b" | cut -d' ' -f1)" = "$want" ]; then
        continue
    fi
    want_xz="$(pinned "$b.xz")"
    [ -n "$want_xz" ] || die "SHA256SUMS names no checksum for $b.xz"
    [ "$(sha256sum "$src/$b.xz" | cut -d' ' -f1)" = "$want_xz" ] || die "$src/$b.xz does not match SHA256SUMS"
    xz -dc "$src/$b.xz" > "$dir/$b.tmp"
    [ "$(sha256sum "$dir/$b.tmp" | cut -d' ' -f1)" = "$want" ] || die "$b unpacked from $b.xz does not match SHA256SUMS"
    chmod +x "$dir/$b.tmp"
    mv "$dir/$b.tmp" "$dir/$b"
    echo "install-k8s: unpacked $b" >&2
done

# Debian packages by the file each provides.
packages=()
command -v etcd >/dev/null 2>&1 || packages+=(etcd-server)
command -v containerd >/dev/null 2>&1 || packages+=(containerd)
command -v runc >/dev/null 2>&1 || packages+=(runc)
[ -x /usr/lib/cni/bridge ] || packages+=(containernetworking-plugins)
command -v iptables >/dev/null 2>&1 || packages+=(iptables)
command -v ip >/dev/null 2>&1 || packages+=(iproute2)
if [ "${#packages[@]}" -gt 0 ]; then
    echo "install-k8s: installing Debian's ${packages[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2
    apt-get install -y -qq --no-install-recommends "${packages[@]}" >&2
fi
etcd_bin="$(command -v etcd)" || die "etcd is not on the PATH after installing etcd-server"
ln -sfn "$etcd_bin" "$dir/etcd"

echo "$dir"
