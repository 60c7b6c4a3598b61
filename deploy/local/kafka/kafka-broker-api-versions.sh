#!/bin/sh
# The official image's health probe (deploy/compose.yaml) answers here too.
exec java -Xmx128m -Dlog4j2.configurationFile=/opt/kafka/config/log4j2-tools.properties \
  -cp "/opt/kafka/libs/*" org.apache.kafka.tools.BrokerApiVersionsCommand "$@"
