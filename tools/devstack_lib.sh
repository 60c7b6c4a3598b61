# Helpers shared by tools/devstack.sh and tools/devstack_secure.sh (sourced; needs ROOT
# and STATE set).
LIBS=$ROOT/.cache/kafka/libs

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

