#!/bin/sh
# KAFKA_* variables -> server.properties (as apache/kafka does), format once, run the broker.
set -eu
conf=/opt/kafka/config/server.properties
: "${KAFKA_LOG_DIRS:=/var/lib/kafka/data}"
export KAFKA_LOG_DIRS
env | grep '^KAFKA_' | grep -v -E '^KAFKA_(HEAP_OPTS|OPTS)=' | while IFS='=' read -r name value; do
  key=$(printf '%s' "${name#KAFKA_}" | tr 'A-Z' 'a-z' | sed -e 's/___/-/g' -e 's/__/@/g' -e 's/_/./g' -e 's/@/_/g')
  printf '%s=%s\n' "$key" "$value"
done >"$conf"
cp="/opt/kafka/libs/*"
log="-Dlog4j2.configurationFile=/opt/kafka/config/log4j2.properties"
if [ ! -f "$KAFKA_LOG_DIRS/meta.properties" ]; then
  id=${CLUSTER_ID:-$(java -cp "$cp" $log kafka.tools.StorageTool random-uuid | tail -n 1)}
  java -cp "$cp" $log kafka.tools.StorageTool format -t "$id" -c "$conf"
fi
# shellcheck disable=SC2086  # KAFKA_HEAP_OPTS / KAFKA_OPTS hold several JVM flags
exec java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx1g} ${KAFKA_OPTS:-} -XX:+UseG1GC -Djava.awt.headless=true \
  $log -cp "$cp" kafka.Kafka "$conf"
