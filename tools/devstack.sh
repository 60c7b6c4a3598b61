#!/usr/bin/env bash
# Dev stack on 127.0.0.1 without Docker: a Redis server (Debian's redis-server, installed
# with apt if missing; no persistence) and an Apache Kafka 4.x broker in KRaft mode
# (combined broker + controller; jars resolved from Maven Central with mvn into
# .cache/kafka/libs; storage formatted with Kafka's StorageTool), then the topics.
#
#   tools/devstack.sh up       start what is not running, wait until both answer, create topics
#   tools/devstack.sh down     stop only the processes this script started (by PID)
#   tools/devstack.sh status
#
# Ports: INFLIGHT_DEV_KAFKA_PORT (19092), INFLIGHT_DEV_REDIS_PORT (6390).
# State (pid files, logs, Kafka's data): INFLIGHT_DEV_STATE, default .cache/devstack for
# the default ports and .cache/devstack-<kafka port>-<redis port> for others, so a second
# stack on other ports never mistakes the first one's processes for its own (nor stops them).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
KAFKA_PORT=${INFLIGHT_DEV_KAFKA_PORT:-19092}
CONTROLLER_PORT=$((KAFKA_PORT + 1))
REDIS_PORT=${INFLIGHT_DEV_REDIS_PORT:-6390}
if [ "$KAFKA_PORT:$REDIS_PORT" = "19092:6390" ]; then
  STATE=${INFLIGHT_DEV_STATE:-$ROOT/.cache/devstack}
else
  STATE=${INFLIGHT_DEV_STATE:-$ROOT/.cache/devstack-$KAFKA_PORT-$REDIS_PORT}
fi
LIBS=$ROOT/.cache/kafka/libs
mkdir -p "$STATE"

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() {  # name port seconds pidfile logfile
  for _ in $(seq 1 "$3"); do
    port_open "$2" && return 0
    if ! alive "$4"; then echo "devstack: $1 exited; last log lines:" >&2; tail -n 30 "$5" >&2 || true; return 1; fi
    sleep 1
  done
  echo "devstack: $1 did not answer on port $2 within $3 s" >&2; tail -n 30 "$5" >&2 || true; return 1
}

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

kafka_libs() {
  if [ ! -f "$LIBS/.complete" ]; then
    echo "devstack: resolving Kafka jars from Maven Central into $LIBS" >&2
    rm -rf "$LIBS"
    if ! mvn -q -B -f tools/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory="$LIBS" \
        -DincludeScope=runtime >"$STATE/mvn.log" 2>&1; then
      cat "$STATE/mvn.log" >&2
      echo "devstack: mvn could not resolve Kafka's jars (log above)" >&2
      exit 1
    fi
    touch "$LIBS/.complete"
  fi
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
log.dirs=$dir/data
num.partitions=6
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=6
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
group.consumer.session.timeout.ms=45000
message.max.bytes=16777216
replica.fetch.max.bytes=16777216
log.retention.hours=24
PROPS
  cat > "$dir/log4j2.properties" <<PROPS
rootLogger.level=WARN
rootLogger.appenderRef.file.ref=file
appender.file.type=File
appender.file.name=file
appender.file.fileName=$STATE/kafka.log
appender.file.layout.type=PatternLayout
appender.file.layout.pattern=[%d] %p %m (%c)%n
PROPS
  local cp="$LIBS/*"
  if [ ! -f "$dir/data/meta.properties" ]; then
    local cluster
    cluster=$(java -cp "$cp" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)
    java -cp "$cp" -Dlog4j2.configurationFile="$dir/log4j2.properties" \
      kafka.tools.StorageTool format -t "$cluster" -c "$dir/server.properties" >"$STATE/kafka-format.log" 2>&1
  fi
  nohup java -Xms256m -Xmx768m -XX:+UseG1GC -Djava.awt.headless=true \
    -Dlog4j2.configurationFile="$dir/log4j2.properties" -cp "$cp" kafka.Kafka "$dir/server.properties" \
    >"$STATE/kafka.out" 2>&1 &
  echo $! >"$STATE/kafka.pid"
  wait_port kafka "$KAFKA_PORT" 90 "$STATE/kafka.pid" "$STATE/kafka.out"
}

down_one() {  # name pidfile
  if alive "$2"; then
    local pid; pid=$(cat "$2")
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 1 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
    kill -9 "$pid" 2>/dev/null || true
    echo "devstack: stopped $1 (pid $pid)"
  fi
  rm -f "$2"
}

case "${1:-up}" in
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
  *) echo "usage: tools/devstack.sh up|down|status" >&2; exit 2 ;;
esac
