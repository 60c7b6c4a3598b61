# Helpers shared by tools/stack/devstack.sh and tools/stack/devstack_secure.sh (sourced; needs ROOT
# and STATE set).
LIBS=$ROOT/.cache/kafka/libs
# The JVMs run with the client compiler only (TieredStopAtLevel=1): a dev broker's
# throughput is far above what a test or the demo asks, while the server compiler's work
# in a broker's first minute was half its CPU (a fresh broker, 15 s: 12-15 CPU-s before,
# 6-7 after; its StorageTool runs 7 -> 5 CPU-s), taken from the tests on the 2-core box.
JAVA_BROKER=(java -Xms256m -Xmx768m -XX:+UseG1GC -XX:TieredStopAtLevel=1 -Djava.awt.headless=true)
JAVA_TOOL=(java -XX:TieredStopAtLevel=1 -XX:+UseSerialGC)  # one-shot tools (StorageTool, AclCommand)

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() {  # name port seconds pidfile logfile [polls per second, default 1]
  local per_s=${6:-1}
  for _ in $(seq 1 $(($3 * per_s))); do
    port_open "$2" && return 0
    if ! alive "$4"; then echo "devstack: $1 exited; last log lines:" >&2; tail -n 30 "$5" >&2 || true; return 1; fi
    sleep "$(printf '%d.%03d' $((1 / per_s)) $((1000 / per_s % 1000)))"
  done
  echo "devstack: $1 did not answer on port $2 within $3 s" >&2; tail -n 30 "$5" >&2 || true; return 1
}

kafka_libs() {
  if [ ! -f "$LIBS/.complete" ]; then
    echo "devstack: resolving Kafka jars from Maven Central into $LIBS" >&2
    rm -rf "$LIBS"
    if ! mvn -q -B -f tools/stack/kafka/pom.xml dependency:copy-dependencies -DoutputDirectory="$LIBS" \
        -DincludeScope=runtime >"$STATE/mvn.log" 2>&1; then
      cat "$STATE/mvn.log" >&2
      echo "devstack: mvn could not resolve Kafka's jars (log above)" >&2
      exit 1
    fi
    touch "$LIBS/.complete"
  fi
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

broker_common_props() {  # partitions dir: the storage, group and size settings both dev brokers share
  cat <<PROPS
log.dirs=$2/data
num.partitions=$1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=$1
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
}

kafka_log4j() {  # dir: a broker's log4j2.properties, warnings and above into $STATE/kafka.log
  cat >"$1/log4j2.properties" <<PROPS
rootLogger.level=WARN
rootLogger.appenderRef.file.ref=file
appender.file.type=File
appender.file.name=file
appender.file.fileName=$STATE/kafka.log
appender.file.layout.type=PatternLayout
appender.file.layout.pattern=[%d] %p %m (%c)%n
PROPS
}
