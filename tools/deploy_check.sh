#!/usr/bin/env bash
# Run the deployment for real with podman + runc: build the images users build
# (deploy/Dockerfile, deploy/Dockerfile.gateway) on a debootstrapped Debian, plus local
# Kafka, Redis and Prometheus images (deploy/local/) for a host that reaches no image
# registry, then tests/deploy: the Compose stack (deploy/compose.yaml +
# deploy/compose.local.yaml) serves a CLI job and an `openai` chat request, drains on
# stop, keeps Redis's data; the Kubernetes worker pod (deploy/k8s, `podman kube play`)
# blocks in its preflight on a bad config and becomes ready on a good one.
#
#   tools/deploy_check.sh                 # install what is missing, build, test
#   tools/deploy_check.sh --build-only    # the images only
#   tools/deploy_check.sh --cached        # exit 0 at once (nothing done) unless every image
#                                         # is already built: what tools/test.sh (CI) runs
#   tools/deploy_check.sh -- -k drain     # extra pytest arguments after --
#
# Needs root and apt (podman, runc, debootstrap, catatonit, Java for nothing: Kafka runs in its
# image), the ports of deploy/compose.local.yaml free (9092, 9093, 19192, 6379, 8000,
# 8080, 9090). Caches: the Debian root file system under .cache/deploy/ (debootstrap
# takes ~1 min), the images in podman's store, pip's downloads in a build cache mount.
# Image sizes and build times go to .cache/deploy/images.json.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
export CONTAINERS_CONF=$ROOT/tools/podman/containers.conf
CACHE=$ROOT/.cache/deploy
COMPOSE_VERSION=1.6.0
BASE=localhost/debian:bookworm-min
KAFKA_IMAGE=localhost/inflight-kafka:4.1.1
IMAGES=(localhost/inflight-python:3.11 localhost/inflight-worker:latest localhost/inflight-gateway:latest
  "$KAFKA_IMAGE" localhost/inflight-redis:7 localhost/inflight-prometheus:2)

build_only=0 cached=0 pytest_args=()
while [ $# -gt 0 ]; do
  case $1 in
    --build-only) build_only=1 ;;
    --cached) cached=1 ;;
    --) shift; pytest_args=("$@"); break ;;
    *) echo "deploy_check: unknown argument $1 (--build-only, --cached, -- PYTEST_ARGS)" >&2; exit 2 ;;
  esac
  shift
done

if [ $cached = 1 ]; then
  for image in "${IMAGES[@]}"; do
    if ! command -v podman >/dev/null || ! podman image exists "$image" 2>/dev/null; then
      echo "deploy_check: skipped: $image is not built on this machine (a fresh run takes" \
        "6-14 min; run tools/deploy_check.sh by hand)" >&2
      exit 0
    fi
  done
fi

missing=()
# catatonit: podman builds the pod's pause image around it (`kube play`); it is only a
# Recommends of Debian's podman, which --no-install-recommends leaves out.
for cmd in podman runc debootstrap catatonit; do command -v $cmd >/dev/null || missing+=($cmd); done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "deploy_check: needs ${missing[*]} (apt-get install ${missing[*]}, as root)" >&2; exit 1
  fi
  echo "deploy_check: installing ${missing[*]} with apt" >&2
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
mkdir -p "$CACHE"
COMPOSE_HOME=$ROOT/.cache/tools/podman-compose-$COMPOSE_VERSION
if [ ! -x "$COMPOSE_HOME/bin/podman-compose" ]; then
  echo "deploy_check: installing podman-compose $COMPOSE_VERSION from PyPI into $COMPOSE_HOME" >&2
  rm -rf "$COMPOSE_HOME" && python3 -m venv "$COMPOSE_HOME"
  "$COMPOSE_HOME/bin/pip" install --quiet "podman-compose==$COMPOSE_VERSION"
fi
export PODMAN_COMPOSE=$COMPOSE_HOME/bin/podman-compose

# The base: Debian bookworm minbase, debootstrapped once per clone (the tarball cached).
if ! podman image exists "$BASE"; then
  if [ ! -f "$CACHE/debian-bookworm-min.tar" ]; then
    echo "deploy_check: debootstrap bookworm (minbase) into $CACHE/rootfs" >&2
    rm -rf "$CACHE/rootfs"
    debootstrap --variant=minbase bookworm "$CACHE/rootfs" http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
      || { tail -n 20 "$CACHE/debootstrap.log" >&2; exit 1; }
    tar -C "$CACHE/rootfs" -cf "$CACHE/debian-bookworm-min.tar.tmp" . && mv "$CACHE/debian-bookworm-min.tar.tmp" "$CACHE/debian-bookworm-min.tar"
    rm -rf "$CACHE/rootfs"
  fi
  podman import --quiet "$CACHE/debian-bookworm-min.tar" "$BASE" >/dev/null
fi

# Kafka's jars, resolved by the dev stack's own helper (tools/stack/kafka/pom.xml), in a build context of their own.
STATE=$CACHE
# shellcheck source=devstack_lib.sh
source tools/stack/devstack_lib.sh
kafka_libs
rm -rf "$CACHE/kafka-context" && cp -r deploy/local/kafka "$CACHE/kafka-context" && cp -r "$LIBS" "$CACHE/kafka-context/libs"

# pip inside the builds trusts what the host's pip trusts (a TLS-intercepting proxy's CA).
cert=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
secret=()
[ -f "$cert" ] && secret=(--secret "id=pip_cert,src=$cert")
report="$CACHE/images.json.tmp"
echo "{" >"$report"
build() {  # image dockerfile context [args...]
  local image=$1 file=$2 context=$3; shift 3
  local t0 t1
  t0=$(date +%s.%N)
  echo "deploy_check: building $image ($file)" >&2
  if ! podman build --format docker --network host --quiet --layers "${secret[@]}" -f "$file" -t "$image" "$@" "$context" \
      >"$CACHE/build-${image//[\/:]/_}.log" 2>&1; then
    tail -n 40 "$CACHE/build-${image//[\/:]/_}.log" >&2
    echo "deploy_check: building $image failed (log: $CACHE/build-${image//[\/:]/_}.log)" >&2
    exit 1
  fi
  t1=$(date +%s.%N)
  local size
  size=$(podman image inspect --format '{{.Size}}' "$image")
  printf '  "%s": {"build_s": %.1f, "size_bytes": %s},\n' "$image" "$(echo "$t1 - $t0" | bc)" "$size" >>"$report"
}
build localhost/inflight-python:3.11 deploy/local/Dockerfile.python deploy/local --build-arg "BASE_IMAGE=$BASE"
build localhost/inflight-worker:latest deploy/Dockerfile . --build-arg "CUDA_IMAGE=$BASE"
build localhost/inflight-gateway:latest deploy/Dockerfile.gateway . --build-arg PYTHON_IMAGE=localhost/inflight-python:3.11
build "$KAFKA_IMAGE" "$CACHE/kafka-context/Dockerfile" "$CACHE/kafka-context" --build-arg "BASE_IMAGE=$BASE"
build localhost/inflight-redis:7 deploy/local/Dockerfile.redis deploy/local --build-arg "BASE_IMAGE=$BASE"
build localhost/inflight-prometheus:2 deploy/local/Dockerfile.prometheus deploy/local --build-arg "BASE_IMAGE=$BASE"
printf '  "podman": "%s", "runtime": "%s"\n}\n' "$(podman --version | cut -d' ' -f3)" "$(runc --version | head -n 1)" >>"$report"
mv "$report" "$CACHE/images.json"
cat "$CACHE/images.json"
[ $build_only = 1 ] && exit 0

# A tiny real checkpoint for the worker and the gateway's tokenizer.
if [ ! -f "$CACHE/models/model/config.json" ]; then
  tools/setup_venv.sh
  .venv/bin/python -m tools.make_model "$CACHE/models/model" --arch llama --train-steps 100 >"$CACHE/make_model.log" 2>&1 \
    || { tail -n 20 "$CACHE/make_model.log" >&2; exit 1; }
fi
export INFLIGHT_MODELS_DIR=$CACHE/models INFLIGHT_DEPLOY_CHECK=1
tools/setup_venv.sh
exec .venv/bin/python -m pytest tests/deploy -p no:cacheprovider "${pytest_args[@]}"
