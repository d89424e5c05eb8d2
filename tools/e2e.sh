#!/usr/bin/env bash
# `make e2e`: the chart on a kind cluster, the calc example trained to Complete.
#
# Creates a kind cluster (deploy/kind/cluster.yaml), builds the inharness and calc-harness images
# (tag $TAG, default dev) and loads them into it, installs the chart with deploy/kind/values.yaml,
# applies examples/calc/trainingrun.yaml (the file `inharness run` takes: its pool has backend
# kubernetes; only its HarnessSpec's image is set to the one just built and its steps to
# $E2E_STEPS), waits at most $E2E_TIMEOUT seconds for the TrainingRun's phase Complete and prints
# its rewardHistory. The cluster is deleted at the end unless E2E_KEEP=1. Without docker (with a
# daemon that answers) and kind it says so and exits 0.
set -euo pipefail

SKIP="make e2e needs docker and kind on PATH; skipping"
if ! command -v docker >/dev/null 2>&1 || ! command -v kind >/dev/null 2>&1; then
  echo "$SKIP"
  exit 0
fi
if ! docker info >/dev/null 2>&1; then
  echo "$SKIP"
  echo "(docker is on PATH but its daemon does not answer)"
  exit 0
fi

cd "$(dirname "$0")/.."
ROOT="$PWD"
BIN="$ROOT/.venv/bin"
CLUSTER="${E2E_CLUSTER:-inharness-e2e}"
NAMESPACE="${E2E_NAMESPACE:-inharness}"
TAG="${TAG:-dev}"
STEPS="${E2E_STEPS:-4}"
TIMEOUT="${E2E_TIMEOUT:-2400}"
REGISTRY=ghcr.io/inharness
RUN=calc

make -s .venv/.installed
KUBECTL="$BIN/kubectl"
HELM="$BIN/helm"
WORK="$(mktemp -d)"
export KUBECONFIG="$WORK/kubeconfig"

dump() {
  echo "--- state of namespace $NAMESPACE"
  "$KUBECTL" get trainingruns,rolloutpools,pods,deployments,statefulsets -n "$NAMESPACE" -o wide || true
  "$KUBECTL" get trainingrun "$RUN" -n "$NAMESPACE" -o yaml || true
  "$KUBECTL" get events -n "$NAMESPACE" --sort-by=.lastTimestamp | tail -40 || true
  "$KUBECTL" logs -n "$NAMESPACE" deployment/inharness --tail=80 || true
}
cleanup() {
  if [ "${E2E_KEEP:-0}" = 1 ]; then
    echo "kept kind cluster $CLUSTER (KUBECONFIG=$KUBECONFIG)"
  else
    kind delete cluster --name "$CLUSTER" || true
    rm -rf "$WORK"
  fi
}
trap cleanup EXIT

if ! kind get clusters 2>/dev/null | grep -qx "$CLUSTER"; then
  kind create cluster --name "$CLUSTER" --config deploy/kind/cluster.yaml --wait 180s
fi
kind export kubeconfig --name "$CLUSTER" --kubeconfig "$KUBECONFIG"

TAG="$TAG" tools/images.sh inharness calc-harness
kind load docker-image --name "$CLUSTER" "$REGISTRY/inharness:$TAG" "$REGISTRY/calc-harness:$TAG"

"$KUBECTL" create namespace "$NAMESPACE" --dry-run=client -o yaml | "$KUBECTL" apply -f -
"$KUBECTL" label namespace "$NAMESPACE" --overwrite pod-security.kubernetes.io/enforce=restricted
"$HELM" upgrade --install inharness charts/inharness --namespace "$NAMESPACE" \
  -f deploy/kind/values.yaml \
  --set "image.tag=$TAG" \
  --set "children.gatewayImage=$REGISTRY/calc-harness:$TAG" \
  --set "children.trainerImage=$REGISTRY/calc-harness:$TAG" \
  --wait --timeout 5m

# The example as it is (its pool has backend kubernetes), with the image built here and fewer steps.
"$BIN/python" - examples/calc/trainingrun.yaml "$REGISTRY/calc-harness:$TAG" "$STEPS" > "$WORK/run.yaml" <<'PY'
import sys

import yaml

path, image, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
docs = [d for d in yaml.safe_load_all(open(path, encoding="utf-8")) if d]
for doc in docs:
    if doc["kind"] == "HarnessSpec":
        doc["spec"]["image"] = image
    elif doc["kind"] == "TrainingRun":
        doc["spec"]["steps"] = steps
yaml.safe_dump_all(docs, sys.stdout, sort_keys=False)
PY
"$KUBECTL" apply -n "$NAMESPACE" -f "$WORK/run.yaml"

echo "waiting up to ${TIMEOUT}s for TrainingRun $RUN to reach Complete"
deadline=$((SECONDS + TIMEOUT))
last=""
while :; do
  now="$("$KUBECTL" get trainingrun "$RUN" -n "$NAMESPACE" \
    -o jsonpath='{.status.phase} step={.status.step} reward={.status.rewardMean}' 2>/dev/null || true)"
  if [ "$now" != "$last" ]; then
    echo "  $now"
    last="$now"
  fi
  case "$now" in
    Complete*) break ;;
    Failed*) dump; echo "TrainingRun $RUN failed" >&2; exit 1 ;;
  esac
  if [ "$SECONDS" -ge "$deadline" ]; then
    dump
    echo "TrainingRun $RUN did not reach Complete within ${TIMEOUT}s" >&2
    exit 1
  fi
  sleep 5
done
echo "rewardHistory: $("$KUBECTL" get trainingrun "$RUN" -n "$NAMESPACE" -o jsonpath='{.status.rewardHistory}')"
"$KUBECTL" get trainingruns -n "$NAMESPACE"
