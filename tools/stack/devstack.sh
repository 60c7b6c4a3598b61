#!/usr/bin/env bash
# Dev stack on 127.0.0.1 without Docker: a Redis server (Debian's redis-server, installed
# with apt if missing; no persistence) and an Apache Kafka 4.x broker in KRaft mode
# (combined broker + controller; jars resolved from Maven Central with mvn into
# .cache/kafka/libs; storage formatted with Kafka's StorageTool), then the topics.
#
#   tools/stack/devstack.sh up       start what is not running, wait until both answer, create topics
#   tools/stack/devstack.sh down     stop only the processes this script started (by PID)
#   tools/stack/devstack.sh status
#   tools/stack/devstack.sh up|down|status --secure
#                              the secured stack beside the open one (its own ports and state):
#                              TLS, SASL/SCRAM, mutual TLS and ACLs; see tools/stack/devstack_secure.sh
#
# Ports: INFLIGHT_DEV_KAFKA_PORT (19092), INFLIGHT_DEV_REDIS_PORT (6390).
# State (pid files, logs, Kafka's data): INFLIGHT_DEV_STATE, default .cache/devstack for
# the default ports and .cache/devstack-<kafka port>-<redis port> for others, so a second
# stack on other ports never mistakes the first one's processes for its own (nor stops them).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
ACTION=${1:-up}
if [ "${2:-}" = "--secure" ] || [ "${1:-}" = "--secure" ]; then
  [ "${1:-}" = "--secure" ] && ACTION=${2:-up}
  exec tools/stack/devstack_secure.sh "$ACTION"
fi
KAFKA_PORT=${INFLIGHT_DEV_KAFKA_PORT:-19092}
CONTROLLER_PORT=$((KAFKA_PORT + 1))
REDIS_PORT=${INFLIGHT_DEV_REDIS_PORT:-6390}
if [ "$KAFKA_PORT:$REDIS_PORT" = "19092:6390" ]; then
  STATE=${INFLIGHT_DEV_STATE:-$ROOT/.cache/devstack}
else
  STATE=${INFLIGHT_DEV_STATE:-$ROOT/.cache/devstack-$KAFKA_PORT-$REDIS_PORT}
fi
mkdir -p "$STATE"
source tools/stack/devstack_lib.sh

redis_up() {
  if alive "$STATE/redis.pid"; then return 0; fi
  if port_open "$REDIS_PORT"; then echo "devstack: something already answers on port $REDIS_PORT; using it as Redis" >&2; return 0; fi
  if ! command -v redis-server >/dev/null; then
    echo "devstack: installing redis-server with apt" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  fi
  redis-server --bind 127.0.0.1 --port "$REDIS_PORT" --save "" --appendonly no --daemonize yes \
    --pidfile "$STATE/redis.pid" --logfile "$STATE/redis.log" --dir "$STATE"
  for _ in $(seq 1 50); do [ -s "$STATE/redis.pid" ] && break; sleep 0.1; done
  wait_port redis "$REDIS_PORT" 20 "$STATE/redis.pid" "$STATE/redis.log"
}

kafka_up() {
  if alive "$STATE/kafka.pid"; then return 0; fi
  if port_open "$KAFKA_PORT"; then echo "devstack: something already answers on port $KAFKA_PORT; using it as Kafka" >&2; return 0; fi
  kafka_libs
  local dir=$STATE/kafka
  mkdir -p "$dir"
  cat > "$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=PLAINTEXT://127.0.0.1:$KAFKA_PORT
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
PROPS
  broker_common_props 6 "$dir" >>"$dir/server.properties"
  kafka_log4j "$dir"
  local cp="$LIBS/*"
  if [ ! -f "$dir/data/meta.properties" ]; then
    local cluster
    cluster=$("${JAVA_TOOL[@]}" -cp "$cp" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)
    "${JAVA_TOOL[@]}" -cp "$cp" -Dlog4j2.configurationFile="$dir/log4j2.properties" \
      kafka.tools.StorageTool format -t "$cluster" -c "$dir/server.properties" >"$STATE/kafka-format.log" 2>&1
  fi
  nohup "${JAVA_BROKER[@]}" \
    -Dlog4j2.configurationFile="$dir/log4j2.properties" -cp "$cp" kafka.Kafka "$dir/server.properties" \
    >"$STATE/kafka.out" 2>&1 &
  echo $! >"$STATE/kafka.pid"
  wait_port kafka "$KAFKA_PORT" 90 "$STATE/kafka.pid" "$STATE/kafka.out"
}

case "$ACTION" in
  up)
    redis_up
    kafka_up
    source tools/setup_venv.sh
    .venv/bin/python -m worker topics create --bootstrap "127.0.0.1:$KAFKA_PORT" --partitions 6 --quiet
    echo "devstack: Kafka 127.0.0.1:$KAFKA_PORT, Redis redis://127.0.0.1:$REDIS_PORT/0"
    ;;
  down)
    down_one kafka "$STATE/kafka.pid"
    down_one redis "$STATE/redis.pid"
    ;;
  status)
    alive "$STATE/kafka.pid" && echo "kafka: running (pid $(cat "$STATE/kafka.pid"), port $KAFKA_PORT)" || echo "kafka: stopped"
    alive "$STATE/redis.pid" && echo "redis: running (pid $(cat "$STATE/redis.pid"), port $REDIS_PORT)" || echo "redis: stopped"
    ;;
  *) echo "usage: tools/stack/devstack.sh up|down|status [--secure]" >&2; exit 2 ;;
esac
