#!/usr/bin/env bash
# A tracing back end on 127.0.0.1 for the tests and local use: Jaeger v2 all-in-one
# (OTLP over HTTP and gRPC in, in-memory storage, the query API and UI), built from
# source through the Go module proxy (no release download is reachable here).
#
#   tools/stack/jaeger.sh up       build if missing, start, wait until it answers
#   tools/stack/jaeger.sh build    only build the binary
#   tools/stack/jaeger.sh down     stop the process this script started
#   tools/stack/jaeger.sh status
#
# Ports: INFLIGHT_DEV_JAEGER_OTLP_HTTP_PORT (14318), _OTLP_GRPC_PORT (14317),
# INFLIGHT_DEV_JAEGER_QUERY_PORT (16696: API and UI, http://127.0.0.1:16696).
# The binary (Jaeger v1.76.0's cmd/jaeger, pinned by tools/stack/jaeger/go.mod and go.sum) is
# cached outside the checkout, in INFLIGHT_JAEGER_BIN (default
# ~/.cache/inflight/jaeger-v1.76.0/jaeger), so every clone on a machine shares one
# build. Cost on a machine with nothing cached: about 2.5 min of module downloads and
# 6 min of compiling on 2 cores; then 0 (the start itself takes about 3 s).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
ACTION=${1:-up}
STATE=${INFLIGHT_DEV_STATE:-$ROOT/.cache/devstack}
mkdir -p "$STATE"
source tools/stack/devstack_lib.sh
BIN=${INFLIGHT_JAEGER_BIN:-$HOME/.cache/inflight/jaeger-v1.76.0/jaeger}
export JAEGER_OTLP_HTTP_PORT=${INFLIGHT_DEV_JAEGER_OTLP_HTTP_PORT:-14318}
export JAEGER_OTLP_GRPC_PORT=${INFLIGHT_DEV_JAEGER_OTLP_GRPC_PORT:-14317}
export JAEGER_QUERY_PORT=${INFLIGHT_DEV_JAEGER_QUERY_PORT:-16696}
export JAEGER_QUERY_GRPC_PORT=$((JAEGER_QUERY_PORT - 1))
export JAEGER_HEALTH_PORT=$((JAEGER_QUERY_PORT + 1))

build() {
  [ -x "$BIN" ] && return 0
  command -v go >/dev/null || { echo "jaeger: needs Go (https://go.dev) to build Jaeger" >&2; exit 1; }
  echo "jaeger: building Jaeger v1.76.0 into $BIN (first time on this machine: ~9 min)" >&2
  mkdir -p "$(dirname "$BIN")"
  (cd tools/stack/jaeger && go build -o "$BIN.tmp" github.com/jaegertracing/jaeger/cmd/jaeger) >"$STATE/jaeger-build.log" 2>&1 || {
    tail -n 30 "$STATE/jaeger-build.log" >&2; echo "jaeger: build failed (log above)" >&2; exit 1; }
  mv "$BIN.tmp" "$BIN"
}

up() {
  if alive "$STATE/jaeger.pid"; then return 0; fi
  if port_open "$JAEGER_QUERY_PORT"; then
    echo "jaeger: something already answers on port $JAEGER_QUERY_PORT; using it as Jaeger" >&2; return 0
  fi
  build
  nohup "$BIN" --config "file:$ROOT/tools/stack/jaeger/config.yaml" >"$STATE/jaeger.log" 2>&1 &
  echo $! >"$STATE/jaeger.pid"
  wait_port jaeger "$JAEGER_QUERY_PORT" 60 "$STATE/jaeger.pid" "$STATE/jaeger.log" 10
  wait_port jaeger-otlp "$JAEGER_OTLP_HTTP_PORT" 30 "$STATE/jaeger.pid" "$STATE/jaeger.log" 10
  echo "jaeger: up (OTLP http://127.0.0.1:$JAEGER_OTLP_HTTP_PORT and :$JAEGER_OTLP_GRPC_PORT, UI and API http://127.0.0.1:$JAEGER_QUERY_PORT)"
}

case "$ACTION" in
  up) up ;;
  build) build ;;
  down) down_one jaeger "$STATE/jaeger.pid" ;;
  status) if alive "$STATE/jaeger.pid"; then echo "jaeger: running (pid $(cat "$STATE/jaeger.pid"))"; else echo "jaeger: not running"; fi ;;
  *) echo "usage: tools/stack/jaeger.sh up|build|down|status" >&2; exit 2 ;;
esac
