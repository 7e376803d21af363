#!/usr/bin/env bash
# Unpacks ROCm's HIP headers and runtime library (Debian's libamdhip64-dev
# and libamdhip64-N, from Debian unstable) into a directory, without
# installing them, for tests/test_hip_compile.py's host compile: the GPU
# transport's host code needs ROCm 6 (gfx1201 needs 6.3+), and the HIP that
# Debian stable installs (5.2) is older. The packages' current version is read
# from unstable's package index, and each file is checked against the
# index's SHA256 before it is unpacked.
#
#   bash scripts/fetch_rocm_headers.sh [DIR]   # default: $RDNA4_COMM_ROCM_ROOT or /opt/rdna4_comm/rocm
#
# DIR/usr/include/hip holds the headers, DIR/usr/lib/x86_64-linux-gnu the
# library. Needs curl, xz and dpkg-deb.
set -euo pipefail

DEST="${1:-${RDNA4_COMM_ROCM_ROOT:-/opt/rdna4_comm/rocm}}"
MIRROR="${RDNA4_COMM_DEBIAN_MIRROR:-http://deb.debian.org/debian}"
INDEX="$MIRROR/dists/sid/main/binary-amd64/Packages.xz"

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

curl -fsS --retry 3 "$INDEX" | xz -dc > "$work/Packages"
# "Filename SHA256 Version" of the package named $1.
entry() {
  awk -v want="$1" '
    /^Package: / { name = $2 }
    name == want && /^Version: / { version = $2 }
    name == want && /^Filename: / { file = $2 }
    name == want && /^SHA256: / { sum = $2 }
    /^$/ { if (name == want && file != "") { print file, sum, version; exit } name = "" }
  ' "$work/Packages"
}
read -r dev_file dev_sum version <<< "$(entry libamdhip64-dev)"
[ -n "${dev_file:-}" ] || { echo "fetch_rocm_headers: libamdhip64-dev is not in $INDEX" >&2; exit 1; }
major="${version%%.*}"
[ "$major" -ge 6 ] || { echo "fetch_rocm_headers: libamdhip64-dev $version is older than ROCm 6" >&2; exit 1; }
read -r lib_file lib_sum _ <<< "$(entry "libamdhip64-$major")"
[ -n "${lib_file:-}" ] || { echo "fetch_rocm_headers: libamdhip64-$major is not in $INDEX" >&2; exit 1; }

mkdir -p "$DEST"
for pair in "$dev_file $dev_sum" "$lib_file $lib_sum"; do
  read -r file sum <<< "$pair"
  deb="$work/$(basename "$file")"
  curl -fsS --retry 3 -o "$deb" "$MIRROR/$file"
  echo "$sum  $deb" | sha256sum -c --quiet -
  dpkg-deb -x "$deb" "$DEST"
done
echo "fetch_rocm_headers: HIP $version in $DEST ($(grep -m1 HIP_VERSION_MAJOR "$DEST/usr/include/hip/hip_version.h"))"
