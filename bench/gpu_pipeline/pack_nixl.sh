#!/usr/bin/env bash
# NIXL for the GPU machine (Python 3.12, no network there, 64 MiB of carried files): the nixl meta
# wheel and the nixl_cu13 wheel's packages without nixl_ep_cu13 (expert-parallel kernels the
# bench never loads), packed as DIR/nixl_cu13-V-cp312-stripped.tar.xz, which `make
# bench-gpu-pipeline` unpacks into NIXL_SITE. Run here, then carry DIR (default .whl, ignored by
# git) with the device tool.
#   bash bench/gpu_pipeline/pack_nixl.sh [DIR]      NIXL_VERSION=1.5.1 by default
set -euo pipefail
version=${NIXL_VERSION:-1.5.1}
out=${1:-.whl}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 -d "$tmp" "nixl==$version" "nixl-cu13==$version"
mkdir -p "$out" "$tmp/x"
cp "$tmp/nixl-$version-py3-none-any.whl" "$out/"
python3 -m zipfile -e "$tmp"/nixl_cu13-"$version"-cp312-*.whl "$tmp/x"
tar -cJf "$out/nixl_cu13-$version-cp312-stripped.tar.xz" -C "$tmp/x" nixl_cu13 nixl_cu13.libs \
  .nixl_cu13.mesonpy.libs "nixl_cu13-$version.dist-info"
ls -l "$out"
