#!/usr/bin/env bash
# A replicated dev stack on 127.0.0.1 without Docker, for the faults a production cluster has:
#
#   * three Apache Kafka 4.x nodes in KRaft mode, each a combined broker + controller (three
#     controller voters: the quorum survives one node lost). Combined rather than dedicated
#     controllers because six JVMs do not fit a 2-core box beside a worker; the faults this
#     stack is for (a leader, the group coordinator or the active controller killed, a rolling
#     restart) all happen with combined nodes too. Topics are created with replication
#     factor 3 and the brokers' min.insync.replicas is 2 (internal topics too), so an
#     `acks=all` write survives any one node.
#   * Redis: a master, one replica (asynchronous replication: a failover can lose the last
#     writes) and three Sentinels (quorum 2) watching the master as service `inflight`.
#     Sentinels are redis-server in sentinel mode, the same binary as Debian's redis-sentinel.
#
#   tools/stack/cluster.sh up        start what is not running, wait until all answer, create topics
#   tools/stack/cluster.sh down      stop only the processes this script started (by PID)
#   tools/stack/cluster.sh status
#   tools/stack/cluster.sh env       the addresses a worker, client or test uses (shell syntax)
#
# Ports (all below the kernel's ephemeral range, 32768+, so no client's outgoing connection
# can hold one while its server is down): INFLIGHT_CLUSTER_KAFKA_PORT K (19192): brokers on
# K, K+1, K+2, controllers on K+3, K+4, K+5. INFLIGHT_CLUSTER_REDIS_PORT R (6490): master R,
# replica R+1, Sentinels R+2, R+3, R+4. State: INFLIGHT_CLUSTER_STATE, default
# .cache/cluster-K-R. A worker reaches Redis through the Sentinels with
#   redis.url = redis+sentinel://127.0.0.1:R+2,127.0.0.1:R+3,127.0.0.1:R+4/inflight/0
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
ACTION=${1:-up}
K=${INFLIGHT_CLUSTER_KAFKA_PORT:-19192}
R=${INFLIGHT_CLUSTER_REDIS_PORT:-6490}
STATE=${INFLIGHT_CLUSTER_STATE:-$ROOT/.cache/cluster-$K-$R}
PARTITIONS=${INFLIGHT_CLUSTER_PARTITIONS:-6}
SERVICE=inflight
mkdir -p "$STATE"
source tools/stack/devstack_lib.sh

bootstrap() { echo "127.0.0.1:$K,127.0.0.1:$((K + 1)),127.0.0.1:$((K + 2))"; }
sentinel_url() { echo "redis+sentinel://127.0.0.1:$((R + 2)),127.0.0.1:$((R + 3)),127.0.0.1:$((R + 4))/$SERVICE/0"; }

install_redis() {
  if ! command -v redis-server >/dev/null; then
    echo "cluster: installing redis-server with apt" >&2
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  fi
}

redis_node_up() {  # name port [replicaof-port]
  local pidf=$STATE/$1.pid
  if alive "$pidf"; then return 0; fi
  local extra=()
  [ -n "${3:-}" ] && extra=(--replicaof 127.0.0.1 "$3")
  # No persistence, as the single dev stack: a node restarted empty is a data loss the
  # workers' restore rules handle; Sentinel makes it a replica of the current master.
  redis-server --bind 127.0.0.1 --port "$2" --save "" --appendonly no --daemonize yes \
    --pidfile "$pidf" --logfile "$STATE/$1.log" --dir "$STATE" "${extra[@]}"
  for _ in $(seq 1 50); do [ -s "$pidf" ] && break; sleep 0.1; done
  wait_port "$1" "$2" 20 "$pidf" "$STATE/$1.log"
}

sentinel_up() {  # index
  local port=$((R + 2 + $1)) name=sentinel$1
  local pidf=$STATE/$name.pid conf=$STATE/$name.conf
  if alive "$pidf"; then return 0; fi
  if [ ! -f "$conf" ]; then  # Sentinel rewrites its file (the current master, its peers): kept across restarts
    cat >"$conf" <<CONF
bind 127.0.0.1
port $port
daemonize yes
pidfile $pidf
logfile $STATE/$name.log
dir $STATE
sentinel monitor $SERVICE 127.0.0.1 $R 2
sentinel down-after-milliseconds $SERVICE 2000
sentinel failover-timeout $SERVICE 10000
sentinel parallel-syncs $SERVICE 1
CONF
  fi
  redis-server "$conf" --sentinel
  for _ in $(seq 1 50); do [ -s "$pidf" ] && break; sleep 0.1; done
  wait_port "$name" "$port" 20 "$pidf" "$STATE/$name.log"
}

kafka_node_up() {  # index 0..2
  local i=$1 port=$((K + $1)) name=kafka$1
  local pidf=$STATE/$name.pid dir=$STATE/$name
  if alive "$pidf"; then return 0; fi
  kafka_libs
  mkdir -p "$dir"
  local voters="1@127.0.0.1:$((K + 3)),2@127.0.0.1:$((K + 4)),3@127.0.0.1:$((K + 5))"
  cat >"$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=$((i + 1))
controller.quorum.voters=$voters
listeners=PLAINTEXT://127.0.0.1:$port,CONTROLLER://127.0.0.1:$((K + 3 + i))
advertised.listeners=PLAINTEXT://127.0.0.1:$port
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
PROPS
  broker_common_props "$PARTITIONS" "$dir" >>"$dir/server.properties"
  # Replicated: later keys win over broker_common_props' single-node values.
  cat >>"$dir/server.properties" <<PROPS
default.replication.factor=3
min.insync.replicas=2
offsets.topic.replication.factor=3
transaction.state.log.replication.factor=3
transaction.state.log.min.isr=2
share.coordinator.state.topic.replication.factor=3
share.coordinator.state.topic.min.isr=2
unclean.leader.election.enable=false
broker.session.timeout.ms=6000
broker.heartbeat.interval.ms=1000
PROPS
  kafka_log4j_to "$dir" "$STATE/$name.log"
  local cp="$LIBS/*"
  if [ ! -f "$dir/data/meta.properties" ]; then
    "${JAVA_TOOL[@]}" -cp "$cp" -Dlog4j2.configurationFile="$dir/log4j2.properties" \
      kafka.tools.StorageTool format -t "$(cluster_id)" -c "$dir/server.properties" >"$STATE/$name-format.log" 2>&1
  fi
  nohup "${JAVA_BROKER[@]}" -Dlog4j2.configurationFile="$dir/log4j2.properties" -cp "$cp" \
    kafka.Kafka "$dir/server.properties" >"$STATE/$name.out" 2>&1 &
  echo $! >"$pidf"
}

cluster_id() {  # one id for the three nodes, made once
  if [ ! -s "$STATE/cluster.id" ]; then
    "${JAVA_TOOL[@]}" -cp "$LIBS/*" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1 >"$STATE/cluster.id"
  fi
  cat "$STATE/cluster.id"
}

kafka_log4j_to() {  # dir logfile: a node's warnings and above into its own file
  kafka_log4j "$1"
  sed -i "s|^appender.file.fileName=.*|appender.file.fileName=$2|" "$1/log4j2.properties"
}

case "$ACTION" in
  up)
    install_redis
    redis_node_up redis-master "$R"
    redis_node_up redis-replica "$((R + 1))" "$R"
    for s in 0 1 2; do sentinel_up "$s"; done
    for i in 0 1 2; do kafka_node_up "$i"; done
    for i in 0 1 2; do wait_port "kafka$i" "$((K + i))" 120 "$STATE/kafka$i.pid" "$STATE/kafka$i.out"; done
    source tools/setup_venv.sh
    .venv/bin/python -m worker topics create --bootstrap "$(bootstrap)" --partitions "$PARTITIONS" \
      --replication-factor 3 --quiet
    echo "cluster: Kafka $(bootstrap), Redis $(sentinel_url)"
    ;;
  down)
    for i in 0 1 2; do down_one "kafka$i" "$STATE/kafka$i.pid"; done
    for s in 0 1 2; do down_one "sentinel$s" "$STATE/sentinel$s.pid"; done
    down_one redis-replica "$STATE/redis-replica.pid"
    down_one redis-master "$STATE/redis-master.pid"
    ;;
  status)
    for n in kafka0 kafka1 kafka2 redis-master redis-replica sentinel0 sentinel1 sentinel2; do
      alive "$STATE/$n.pid" && echo "$n: running (pid $(cat "$STATE/$n.pid"))" || echo "$n: stopped"
    done
    ;;
  env)
    echo "INFLIGHT_KAFKA=$(bootstrap)"
    echo "INFLIGHT_REDIS=$(sentinel_url)"
    echo "INFLIGHT_CLUSTER_STATE=$STATE"
    ;;
  *) echo "usage: tools/stack/cluster.sh up|down|status|env" >&2; exit 2 ;;
esac
