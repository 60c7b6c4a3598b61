#!/usr/bin/env bash
# The secured dev stack (`tools/stack/devstack.sh up|down|status --secure`), beside the open one,
# with its own ports and state: what production Kafka and Redis look like, so the tests
# prove every component connects to them.
#
#   Kafka 4.x (KRaft, StandardAuthorizer, super users inflight-broker and inflight-admin):
#     127.0.0.1:29092  SASL_SSL        SCRAM-SHA-512, SCRAM-SHA-256, PLAIN
#     127.0.0.1:29093  SSL             client certificate required (mutual TLS); the
#                                      principal is the certificate's CN
#     127.0.0.1:29094  SASL_PLAINTEXT  SCRAM-SHA-512, SCRAM-SHA-256, PLAIN
#     127.0.0.1:29095  controller      mutual TLS
#     SCRAM users made by Kafka's StorageTool (`format --add-scram`); ACLs by Kafka's
#     AclCommand from `inflight acl kafka` (worker/security/acl.py); topics `inflight.*`,
#     group `inflight-workers`.
#   Redis: TLS only on 127.0.0.1:6393, client certificate required, ACL users from
#     `inflight acl redis` (worker/security/acl.py): inflight-admin (all), inflight-worker,
#     inflight-client (reader of jobs without a tenant, may set tombstones),
#     inflight-reader-tenant-a / -tenant-b; the default user is off.
#
# Principals (the same names for SASL users, certificate CNs and Redis users):
# inflight-admin, inflight-worker, inflight-producer, inflight-noacl (authenticates,
# holds no ACL). A throwaway CA (openssl, EC P-256) signs the broker's / Redis' certificate
# (CN inflight-broker, SAN localhost and 127.0.0.1) and one client certificate per
# principal; a second, untrusted CA ("rogue") signs a certificate for the tests. The
# worker's client key is encrypted (password in secrets/inflight-worker.key-password).
#
# State under INFLIGHT_DEV_STATE (default .cache/devstack-secure): certs/, secrets/
# (random passwords, mode 600), configs/<principal>-<mode>.yaml (kafka + redis sections
# for `inflight … --config`; modes scram-sha-512, scram-sha-256, plain, mtls,
# sasl-plaintext) and configs/inflight-reader-<tenant>.yaml (a tenant's client), stack.json (ports and paths, read by the tests), logs and
# Kafka's data. Ports: INFLIGHT_DEV_SECURE_KAFKA_PORT (29092; +1, +2, +3 as above),
# INFLIGHT_DEV_SECURE_REDIS_PORT (6393).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=$PWD
KPORT=${INFLIGHT_DEV_SECURE_KAFKA_PORT:-29092}
SSL_PORT=$((KPORT + 1))
SASL_PLAIN_PORT=$((KPORT + 2))
CONTROLLER_PORT=$((KPORT + 3))
RPORT=${INFLIGHT_DEV_SECURE_REDIS_PORT:-6393}
if [ "$KPORT:$RPORT" = "29092:6393" ]; then
  STATE=${INFLIGHT_DEV_STATE:-$ROOT/.cache/devstack-secure}
else
  STATE=${INFLIGHT_DEV_STATE:-$ROOT/.cache/devstack-secure-$KPORT-$RPORT}
fi
PREFIX=inflight
GROUP=inflight-workers
PRINCIPALS="inflight-admin inflight-worker inflight-producer inflight-noacl"
TENANTS="tenant-a tenant-b"
CERTS=$STATE/certs
SECRETS=$STATE/secrets
source tools/stack/devstack_lib.sh
PY=(env "PYTHONPATH=$ROOT${PYTHONPATH:+:$PYTHONPATH}" "$ROOT/.venv/bin/python")

# ---- certificates and secrets (once per state dir) -------------------------------------
make_cert() {  # file-stem CN signing-CA-stem extensions
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$CERTS/$1.key" 2>/dev/null
  openssl req -new -key "$CERTS/$1.key" -subj "/CN=$2" -out "$CERTS/$1.csr" 2>/dev/null
  printf '%b' "$4" >"$CERTS/$1.ext"
  openssl x509 -req -in "$CERTS/$1.csr" -CA "$CERTS/$3.pem" -CAkey "$CERTS/$3.key" -CAcreateserial -days 3650 \
    -sha256 -extfile "$CERTS/$1.ext" -out "$CERTS/$1.pem" 2>/dev/null
  rm -f "$CERTS/$1.csr" "$CERTS/$1.ext"
}

make_ca() {  # file-stem CN
  openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$CERTS/$1.key" 2>/dev/null
  openssl req -x509 -new -key "$CERTS/$1.key" -sha256 -days 3650 -subj "/CN=$2" -out "$CERTS/$1.pem" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
}

make_material() {
  [ -f "$STATE/.material" ] && return 0
  rm -rf "$CERTS" "$SECRETS" "$STATE/kafka" "$STATE/redis"
  mkdir -p "$CERTS" "$SECRETS"
  chmod 700 "$CERTS" "$SECRETS"
  local client_ext='basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=clientAuth\n'
  make_ca ca "Inflight dev CA"
  make_ca rogue-ca "Rogue CA (untrusted)"
  make_cert server inflight-broker ca \
    'basicConstraints=CA:FALSE\nkeyUsage=digitalSignature\nextendedKeyUsage=serverAuth,clientAuth\nsubjectAltName=DNS:localhost,IP:127.0.0.1\n'
  for p in $PRINCIPALS; do
    make_cert "$p" "$p" ca "$client_ext"
    openssl rand -hex 16 >"$SECRETS/$p.kafka-password"
    openssl rand -hex 16 >"$SECRETS/$p.redis-password"
  done
  for t in $TENANTS; do openssl rand -hex 16 >"$SECRETS/inflight-reader-$t.redis-password"; done
  openssl rand -hex 16 >"$SECRETS/inflight-client.redis-password"
  make_cert rogue-worker inflight-worker rogue-ca "$client_ext"
  # The worker's key encrypted (PKCS#8, AES-256): tests the key password settings.
  openssl rand -hex 16 >"$SECRETS/inflight-worker.key-password"
  openssl pkcs8 -topk8 -v2 aes-256-cbc -in "$CERTS/inflight-worker.key" -out "$CERTS/inflight-worker.key.enc" \
    -passout "file:$SECRETS/inflight-worker.key-password"
  mv "$CERTS/inflight-worker.key.enc" "$CERTS/inflight-worker.key"
  # Kafka's PEM key store: the (PKCS#8, unencrypted) key followed by the certificate.
  cat "$CERTS/server.key" "$CERTS/server.pem" >"$CERTS/broker-keystore.pem"
  chmod 600 "$SECRETS"/* "$CERTS"/*.key "$CERTS/broker-keystore.pem"
  touch "$STATE/.material"
}

pw() { cat "$SECRETS/$1"; }

# ---- Redis: TLS only, client certificates, ACL users -----------------------------------
redis_acl_line() {  # user password-file rules...
  local user=$1 file=$2; shift 2
  echo "user $user on #$(tr -d '\n' <"$SECRETS/$file" | sha256sum | cut -d' ' -f1) $*"
}

secure_redis_up() {
  local dir=$STATE/redis
  if alive "$dir/redis.pid"; then return 0; fi
  if port_open "$RPORT"; then echo "devstack: port $RPORT is taken by another process; set INFLIGHT_DEV_SECURE_REDIS_PORT" >&2; exit 1; fi
  mkdir -p "$dir"
  {
    echo "user default off"
    redis_acl_line inflight-admin inflight-admin.redis-password "~* &* +@all"
    redis_acl_line inflight-worker inflight-worker.redis-password "$("${PY[@]}" -m worker acl redis worker --prefix "$PREFIX")"
    redis_acl_line inflight-client inflight-client.redis-password \
      "$("${PY[@]}" -m worker acl redis reader --may-cancel --prefix "$PREFIX")"
    for t in $TENANTS; do
      redis_acl_line "inflight-reader-$t" "inflight-reader-$t.redis-password" \
        "$("${PY[@]}" -m worker acl redis reader --tenant "$t" --prefix "$PREFIX")"
    done
  } >"$dir/users.acl"
  chmod 600 "$dir/users.acl"
  cat >"$dir/redis.conf" <<CONF
bind 127.0.0.1
port 0
tls-port $RPORT
tls-cert-file $CERTS/server.pem
tls-key-file $CERTS/server.key
tls-ca-cert-file $CERTS/ca.pem
tls-auth-clients yes
save ""
appendonly no
daemonize yes
pidfile $dir/redis.pid
logfile $dir/redis.log
dir $dir
aclfile $dir/users.acl
CONF
  redis-server "$dir/redis.conf"
  for _ in $(seq 1 50); do [ -s "$dir/redis.pid" ] && break; sleep 0.1; done
  wait_port "redis (TLS)" "$RPORT" 20 "$dir/redis.pid" "$dir/redis.log" 5
}

# ---- Kafka: SASL_SSL, SSL (mutual TLS), SASL_PLAINTEXT, StandardAuthorizer ACLs ----------
plain_jaas() {
  local users=""
  for p in $PRINCIPALS; do users+=" user_$p=\"$(pw "$p.kafka-password")\""; done
  echo "org.apache.kafka.common.security.plain.PlainLoginModule required$users;"
}

secure_kafka_up() {
  local dir=$STATE/kafka
  if alive "$dir/kafka.pid"; then return 0; fi
  for port in "$KPORT" "$SSL_PORT" "$SASL_PLAIN_PORT" "$CONTROLLER_PORT"; do
    if port_open "$port"; then echo "devstack: port $port is taken; set INFLIGHT_DEV_SECURE_KAFKA_PORT" >&2; exit 1; fi
  done
  kafka_libs
  mkdir -p "$dir"
  local scram='org.apache.kafka.common.security.scram.ScramLoginModule required;'
  local plain; plain=$(plain_jaas)
  cat >"$dir/server.properties" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CONTROLLER_PORT
listeners=SASL_SSL://127.0.0.1:$KPORT,SSL://127.0.0.1:$SSL_PORT,SASL_PLAINTEXT://127.0.0.1:$SASL_PLAIN_PORT,CONTROLLER://127.0.0.1:$CONTROLLER_PORT
advertised.listeners=SASL_SSL://127.0.0.1:$KPORT,SSL://127.0.0.1:$SSL_PORT,SASL_PLAINTEXT://127.0.0.1:$SASL_PLAIN_PORT
controller.listener.names=CONTROLLER
listener.security.protocol.map=SASL_SSL:SASL_SSL,SSL:SSL,SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:SSL
inter.broker.listener.name=SSL
ssl.keystore.type=PEM
ssl.keystore.location=$CERTS/broker-keystore.pem
ssl.truststore.type=PEM
ssl.truststore.location=$CERTS/ca.pem
listener.name.ssl.ssl.client.auth=required
listener.name.controller.ssl.client.auth=required
ssl.principal.mapping.rules=RULE:^CN=([A-Za-z0-9._-]+)$/\$1/,DEFAULT
sasl.enabled.mechanisms=SCRAM-SHA-512,SCRAM-SHA-256,PLAIN
listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config=$scram
listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config=$scram
listener.name.sasl_ssl.plain.sasl.jaas.config=$plain
listener.name.sasl_plaintext.scram-sha-512.sasl.jaas.config=$scram
listener.name.sasl_plaintext.scram-sha-256.sasl.jaas.config=$scram
listener.name.sasl_plaintext.plain.sasl.jaas.config=$plain
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
super.users=User:inflight-broker;User:inflight-admin
allow.everyone.if.no.acl.found=false
PROPS
  broker_common_props 3 "$dir" >>"$dir/server.properties"
  chmod 600 "$dir/server.properties"
  kafka_log4j "$dir"
  cat >"$dir/admin-client.properties" <<PROPS
security.protocol=SASL_SSL
sasl.mechanism=SCRAM-SHA-512
sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required username="inflight-admin" password="$(pw inflight-admin.kafka-password)";
ssl.truststore.type=PEM
ssl.truststore.location=$CERTS/ca.pem
PROPS
  chmod 600 "$dir/admin-client.properties"
  local cp="$LIBS/*"
  if [ ! -f "$dir/data/meta.properties" ]; then
    local cluster scram_args=()
    cluster=$("${JAVA_TOOL[@]}" -cp "$cp" kafka.tools.StorageTool random-uuid 2>/dev/null | tail -n 1)
    for p in $PRINCIPALS; do
      for mech in SCRAM-SHA-512 SCRAM-SHA-256; do
        scram_args+=(--add-scram "$mech=[name=$p,password=$(pw "$p.kafka-password")]")
      done
    done
    "${JAVA_TOOL[@]}" -cp "$cp" -Dlog4j2.configurationFile="$dir/log4j2.properties" \
      kafka.tools.StorageTool format -t "$cluster" -c "$dir/server.properties" "${scram_args[@]}" \
      >"$STATE/kafka-format.log" 2>&1 || { cat "$STATE/kafka-format.log" >&2; exit 1; }
    rm -f "$dir/.acls"
  fi
  nohup "${JAVA_BROKER[@]}" \
    -Dlog4j2.configurationFile="$dir/log4j2.properties" -cp "$cp" kafka.Kafka "$dir/server.properties" \
    >"$STATE/kafka.out" 2>&1 &
  echo $! >"$dir/kafka.pid"
  wait_port "kafka (secure)" "$KPORT" 90 "$dir/kafka.pid" "$STATE/kafka.out" 5
  wait_port "kafka (mTLS)" "$SSL_PORT" 30 "$dir/kafka.pid" "$STATE/kafka.out" 5
}

secure_acls() {  # Kafka's own AclCommand, one run per grant of `inflight acl kafka`, in parallel
  local dir=$STATE/kafka
  [ -f "$dir/.acls" ] && return 0
  local pids=() n=0
  while IFS= read -r line; do
    n=$((n + 1))
    # shellcheck disable=SC2086  # the line is AclCommand's arguments (no spaces inside names)
    "${JAVA_TOOL[@]}" -cp "$LIBS/*" -Dlog4j2.configurationFile="$dir/log4j2.properties" \
      org.apache.kafka.tools.AclCommand --bootstrap-server "127.0.0.1:$KPORT" \
      --command-config "$dir/admin-client.properties" $line >"$STATE/acl-$n.log" 2>&1 &
    pids+=($!)
  done < <("${PY[@]}" -m worker acl kafka --prefix "$PREFIX" --group "$GROUP")
  local failed=0
  for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { failed=1; cat "$STATE/acl-$((i + 1)).log" >&2; }
  done
  [ "$failed" = 0 ] || { echo "devstack: AclCommand failed (log above)" >&2; exit 1; }
  touch "$dir/.acls"
}

# ---- client configs and the manifest -----------------------------------------------------
write_configs() {
  local c=$STATE/configs
  mkdir -p "$c"
  local redis_tls="url: rediss://127.0.0.1:$RPORT/0
  ssl_cafile: $CERTS/ca.pem
  ssl_check_hostname: true"
  for p in $PRINCIPALS; do
    local ruser=$p keyline=""
    if [ "$p" = inflight-producer ] || [ "$p" = inflight-noacl ]; then ruser=inflight-client; fi
    if [ "$p" = inflight-worker ]; then keyline="
  ssl_key_password_file: $SECRETS/inflight-worker.key-password"; fi
    local redis="redis:
  $redis_tls
  username: $ruser
  password_file: $SECRETS/$ruser.redis-password
  ssl_certfile: $CERTS/$p.pem
  ssl_keyfile: $CERTS/$p.key$keyline"
    for mech in SCRAM-SHA-512 SCRAM-SHA-256 PLAIN; do
      local m=${mech,,}
      cat >"$c/$p-$m.yaml" <<YAML
# $p over SASL_SSL ($mech) to Kafka, TLS + ACL user $ruser to Redis
kafka:
  bootstrap_servers: 127.0.0.1:$KPORT
  topic_prefix: $PREFIX
  group_id: $GROUP
  security_protocol: SASL_SSL
  sasl_mechanism: $mech
  sasl_username: $p
  sasl_password_file: $SECRETS/$p.kafka-password
  ssl_cafile: $CERTS/ca.pem
$redis
YAML
    done
    cat >"$c/$p-mtls.yaml" <<YAML
# $p over SSL with its client certificate (mutual TLS) to Kafka, TLS + ACL user $ruser to Redis
kafka:
  bootstrap_servers: 127.0.0.1:$SSL_PORT
  topic_prefix: $PREFIX
  group_id: $GROUP
  security_protocol: SSL
  ssl_cafile: $CERTS/ca.pem
  ssl_certfile: $CERTS/$p.pem
  ssl_keyfile: $CERTS/$p.key$keyline
$redis
YAML
    cat >"$c/$p-sasl-plaintext.yaml" <<YAML
# $p over SASL_PLAINTEXT (SCRAM-SHA-512) to Kafka, TLS + ACL user $ruser to Redis
kafka:
  bootstrap_servers: 127.0.0.1:$SASL_PLAIN_PORT
  topic_prefix: $PREFIX
  group_id: $GROUP
  security_protocol: SASL_PLAINTEXT
  sasl_mechanism: SCRAM-SHA-512
  sasl_username: $p
  sasl_password_file: $SECRETS/$p.kafka-password
$redis
YAML
  done
  for t in $TENANTS; do
    cat >"$c/inflight-reader-$t.yaml" <<YAML
# A client of $t: submits and cancels as inflight-producer (mutual TLS), streams its jobs as
# the Redis reader user inflight-reader-$t (only channels and logs under inflight:t:$t:job:*)
kafka:
  bootstrap_servers: 127.0.0.1:$SSL_PORT
  topic_prefix: $PREFIX
  security_protocol: SSL
  ssl_cafile: $CERTS/ca.pem
  ssl_certfile: $CERTS/inflight-producer.pem
  ssl_keyfile: $CERTS/inflight-producer.key
redis:
  $redis_tls
  username: inflight-reader-$t
  password_file: $SECRETS/inflight-reader-$t.redis-password
  ssl_certfile: $CERTS/inflight-producer.pem
  ssl_keyfile: $CERTS/inflight-producer.key
YAML
  done
  cat >"$STATE/stack.json" <<JSON
{"state": "$STATE", "prefix": "$PREFIX", "group_id": "$GROUP",
 "kafka": {"sasl_ssl": "127.0.0.1:$KPORT", "ssl": "127.0.0.1:$SSL_PORT", "sasl_plaintext": "127.0.0.1:$SASL_PLAIN_PORT"},
 "redis": "rediss://127.0.0.1:$RPORT/0", "certs": "$CERTS", "secrets": "$SECRETS", "configs": "$c",
 "principals": ["${PRINCIPALS// /\", \"}"], "tenants": ["${TENANTS// /\", \"}"]}
JSON
}

case "${1:-up}" in
  up)
    t0=$(date +%s%N)
    mkdir -p "$STATE"
    chmod 700 "$STATE"
    if ! alive "$STATE/kafka/kafka.pid" && ! alive "$STATE/redis/redis.pid" && [ ! -f "$STATE/.material" ]; then
      rm -rf "$STATE/kafka" "$STATE/redis"  # new certificates and passwords: start from empty state
    fi
    source tools/setup_venv.sh
    make_material
    write_configs
    secure_redis_up
    secure_kafka_up
    secure_acls
    "${PY[@]}" -m worker topics create --config "$STATE/configs/inflight-admin-scram-sha-512.yaml" --partitions 3 --quiet
    ms=$((($(date +%s%N) - t0) / 1000000))
    echo "devstack: secured stack up in $((ms / 1000)).$((ms % 1000 / 100)) s: Kafka SASL_SSL 127.0.0.1:$KPORT," \
      "mTLS 127.0.0.1:$SSL_PORT, SASL_PLAINTEXT 127.0.0.1:$SASL_PLAIN_PORT; Redis rediss://127.0.0.1:$RPORT/0;" \
      "client configs in $STATE/configs"
    ;;
  down)
    down_one "kafka (secure)" "$STATE/kafka/kafka.pid"
    down_one "redis (secure)" "$STATE/redis/redis.pid"
    ;;
  status)
    alive "$STATE/kafka/kafka.pid" && echo "kafka (secure): running (pid $(cat "$STATE/kafka/kafka.pid"), ports $KPORT-$CONTROLLER_PORT)" || echo "kafka (secure): stopped"
    alive "$STATE/redis/redis.pid" && echo "redis (secure): running (pid $(cat "$STATE/redis/redis.pid"), TLS port $RPORT)" || echo "redis (secure): stopped"
    ;;
  *) echo "usage: tools/stack/devstack.sh up|down|status --secure" >&2; exit 2 ;;
esac
