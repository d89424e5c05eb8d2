#!/usr/bin/env bash
# Build the images (`make images`): tools/images.sh [inharness] [trainer] [calc-harness]; all three
# by default, tagged $TAG (default dev). Uses docker, else podman.
set -euo pipefail
engine="$(command -v docker || command -v podman || true)"
if [ -z "$engine" ]; then
  echo "make images needs docker or podman on PATH (neither was found)" >&2
  exit 1
fi
cd "$(dirname "$0")/.."
TAG="${TAG:-dev}"
REGISTRY="${REGISTRY:-ghcr.io/inharness}"
if [ "$(basename "$engine")" = docker ] && ! docker info >/dev/null 2>&1; then
  echo "make images needs a running docker daemon (docker is on PATH but its daemon does not answer)" >&2
  exit 1
fi
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(inharness trainer calc-harness)
for name in "${names[@]}"; do
  case "$name" in
    inharness|trainer) args=() ;;
    calc-harness) args=(--build-arg "BASE_IMAGE=$REGISTRY/inharness:$TAG") ;;
    *) echo "unknown image $name (inharness, trainer, calc-harness)" >&2; exit 2 ;;
  esac
  echo "building $REGISTRY/$name:$TAG"
  "$engine" build -f "docker/Dockerfile.$name" "${args[@]}" -t "$REGISTRY/$name:$TAG" .
done
