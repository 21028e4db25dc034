#!/usr/bin/env bash
# A single-node Apache Kafka (KRaft) for tests and `tierflow up`, run from Maven Central jars:
# no Docker, no tarball download (only package registries are reachable here).
#
#   scripts/kafka.sh fetch                  download (once) the server jars, print the libs dir
#   scripts/kafka.sh fetched                exit 0 when the jars are already here (no Maven needed)
#   scripts/kafka.sh start DIR PORT [CPORT] format DIR (once) and start a broker on
#                                           127.0.0.1:PORT, its controller on CPORT (PORT+1);
#                                           returns when the broker says it started
#   scripts/kafka.sh stop DIR               SIGTERM, then SIGKILL after KAFKA_STOP_TIMEOUT s
#
# The jars live OUTSIDE the clone, shared by every checkout and CI run:
#   ${TIERFLOW_CACHE:-~/.cache/tierflow}/kafka/<version>/libs
# DIR holds server.properties, the data (DIR/data), broker.log, broker.pid and watchdog.pid.
#
# With KAFKA_TLS_DIR set (the broker's own directory, `tierflow certs --export`: ca.pem and
# keystore.pem, its key and certificate as Kafka's PEM keystore; launch.certs.export) both
# listeners are mTLS (SSL, a client certificate required) and an authorizer holds every client
# to its ACLs: a principal is its certificate's common name (User:queue-service), and only the
# broker's own (User:kafka) is a super user, which `launch/kafka_acls.py` uses to grant the rest.
#
# Environment: KAFKA_VERSION (default below), KAFKA_HEAP (512m), KAFKA_START_TIMEOUT (90 s),
# KAFKA_STOP_TIMEOUT (20 s), KAFKA_JVM_OPTS (extra JVM flags), TIERFLOW_KAFKA_OWNER_PID (when
# set, a watchdog stops the broker once that process is gone, so a test run killed with SIGKILL
# leaves no broker behind).
set -euo pipefail

# 4.3.1: the newest release line that kafka-python 3.0 knows the protocol versions of.
KAFKA_VERSION=${KAFKA_VERSION:-4.3.1}
# The log4j2 binding the broker logs through (for the slf4j 1.7 API that Kafka declares); its
# pom leaves the choice of logging backend to the distribution.
LOG4J_VERSION=${LOG4J_VERSION:-2.24.3}
cache=${TIERFLOW_CACHE:-$HOME/.cache/tierflow}
home="$cache/kafka/$KAFKA_VERSION"
libs="$home/libs"

die() {
  echo "kafka.sh: $*" >&2
  exit 1
}

fetch() {
  if [ -f "$libs/.complete" ]; then
    echo "$libs"
    return
  fi
  mkdir -p "$home"
  # One fetch at a time: two test runs starting together must not interleave copies.
  exec 9>"$home/.lock"
  flock 9
  if [ -f "$libs/.complete" ]; then
    echo "$libs"
    return
  fi
  command -v mvn >/dev/null || die "mvn (Maven) is needed to fetch Kafka; install it first"
  echo "kafka.sh: fetching Kafka $KAFKA_VERSION server jars from Maven Central (once)" >&2
  local work
  work=$(mktemp -d)
  # A throwaway project whose only purpose is its dependency tree: kafka_2.13 (the broker) and
  # everything it needs at run time, copied flat into one directory for `java -cp libs/*`.
  cat >"$work/pom.xml" <<EOF
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>dev.tierflow</groupId>
  <artifactId>kafka-server-libs</artifactId>
  <version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.kafka</groupId>
      <artifactId>kafka_2.13</artifactId>
      <version>$KAFKA_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-slf4j-impl</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
    <dependency>
      <groupId>org.apache.logging.log4j</groupId>
      <artifactId>log4j-core</artifactId>
      <version>$LOG4J_VERSION</version>
    </dependency>
  </dependencies>
</project>
EOF
  rm -rf "$libs.tmp"
  if ! mvn -q -B -f "$work/pom.xml" dependency:copy-dependencies \
    -DincludeScope=runtime -DoutputDirectory="$libs.tmp" >"$work/mvn.log" 2>&1; then
    tail -n 40 "$work/mvn.log" >&2
    rm -rf "$work" "$libs.tmp"
    die "fetching Kafka $KAFKA_VERSION failed (Maven output above)"
  fi
  rm -rf "$work"
  ls "$libs.tmp"/kafka_2.13-"$KAFKA_VERSION".jar >/dev/null 2>&1 ||
    die "Maven finished but kafka_2.13-$KAFKA_VERSION.jar is missing"
  touch "$libs.tmp/.complete"
  rm -rf "$libs"
  mv "$libs.tmp" "$libs"
  echo "$libs"
}

# The files the broker's mTLS needs, as `tierflow certs --export` writes them.
check_tls_dir() {
  local tls=$KAFKA_TLS_DIR
  for f in ca.pem keystore.pem; do
    [ -f "$tls/$f" ] || die "KAFKA_TLS_DIR=$tls has no $f (make it with: tierflow certs --export)"
  done
}

# The mTLS and ACL lines of server.properties (KAFKA_TLS_DIR set).
tls_properties() {
  cat <<EOF
# mTLS on both listeners; the CA of tierflow certs is the only trust anchor.
ssl.client.auth=required
ssl.keystore.type=PEM
ssl.keystore.location=$KAFKA_TLS_DIR/keystore.pem
ssl.truststore.type=PEM
ssl.truststore.location=$KAFKA_TLS_DIR/ca.pem
ssl.endpoint.identification.algorithm=https
# A principal is the certificate's common name: CN=queue-service is User:queue-service.
ssl.principal.mapping.rules=RULE:^CN=([^,]+).*\$/\$1/,DEFAULT
# Every request is checked against the ACLs; none found is a denial.
authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer
allow.everyone.if.no.acl.found=false
super.users=User:kafka
EOF
}

# True while PID names a live process (a zombie counts as dead: nobody may reap it here).
alive() {
  local pid=$1 state
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null || echo Z)
  [ "$state" != Z ]
}

start() {
  local dir=${1:?usage: kafka.sh start DIR PORT [CONTROLLER_PORT]}
  local port=${2:?usage: kafka.sh start DIR PORT [CONTROLLER_PORT]}
  local cport=${3:-$((port + 1))}
  fetch >/dev/null
  mkdir -p "$dir"
  dir=$(cd "$dir" && pwd)
  if [ -f "$dir/broker.pid" ] && alive "$(cat "$dir/broker.pid")"; then
    die "a broker already runs from $dir (pid $(cat "$dir/broker.pid"))"
  fi
  local protocol=PLAINTEXT
  if [ -n "${KAFKA_TLS_DIR:-}" ]; then
    protocol=SSL
    check_tls_dir
    KAFKA_TLS_DIR=$(cd "$KAFKA_TLS_DIR" && pwd)  # server.properties needs it absolute
  fi

  cat >"$dir/server.properties" <<EOF
# Written by scripts/kafka.sh: one node that is both broker and controller (KRaft).
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$cport
listeners=$protocol://127.0.0.1:$port,CONTROLLER://127.0.0.1:$cport
advertised.listeners=$protocol://127.0.0.1:$port
listener.security.protocol.map=$protocol:$protocol,CONTROLLER:$protocol
controller.listener.names=CONTROLLER
inter.broker.listener.name=$protocol
log.dirs=$dir/data
# A single replica of everything: the defaults (3) would leave internal topics unavailable.
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
# One partition per internal topic: creating __consumer_offsets with the default 50 costs the
# first consumer group seconds on two busy cores, and one node gains nothing from more.
offsets.topic.num.partitions=1
transaction.state.log.num.partitions=1
# A consumer group starts at once instead of waiting 3 s for more members to join.
group.initial.rebalance.delay.ms=0
num.partitions=1
# Topics are created on purpose (tierflow's ensure_topics), never by a typo.
auto.create.topics.enable=false
# Small thread pools and buffers: this broker shares two cores with tests and other services.
num.network.threads=2
num.io.threads=2
background.threads=2
num.recovery.threads.per.data.dir=1
log.cleaner.dedupe.buffer.size=16777216
EOF
  if [ -n "${KAFKA_TLS_DIR:-}" ]; then
    tls_properties >>"$dir/server.properties"
  fi

  if [ ! -f "$dir/data/meta.properties" ]; then
    # A KRaft cluster id is 16 random bytes, URL-safe base64 without padding (what
    # `kafka-storage random-uuid` prints), made here to save a JVM start. Passed as
    # --cluster-id=ID: one id in 64 starts with "-", which argparse would take for an option.
    local cluster_id
    cluster_id=$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=\n')
    if ! java -Xmx256m -cp "$libs/*" kafka.tools.StorageTool format \
      --cluster-id="$cluster_id" -c "$dir/server.properties" >"$dir/format.log" 2>&1; then
      cat "$dir/format.log" >&2
      die "formatting the KRaft storage in $dir/data failed"
    fi
  fi

  cat >"$dir/log4j2.properties" <<'EOF'
# The broker's own log, to stdout (redirected to broker.log); INFO so a failed start says why.
status = warn
appender.out.type = Console
appender.out.name = STDOUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = STDOUT
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.state.name = state.change.logger
logger.state.level = warn
EOF

  : >"$dir/broker.log"
  # setsid: the broker is not in the caller's process group, so a terminal's Ctrl-C reaches the
  # caller, whose clean-up stops the broker in order; stdio never holds the caller's pipes.
  # shellcheck disable=SC2086
  setsid java -Xmx"${KAFKA_HEAP:-512m}" -Xms128m -XX:+UseSerialGC -XX:TieredStopAtLevel=1 \
    -Djava.awt.headless=true -Dlog4j2.configurationFile="$dir/log4j2.properties" \
    ${KAFKA_JVM_OPTS:-} -cp "$libs/*" kafka.Kafka "$dir/server.properties" \
    </dev/null >>"$dir/broker.log" 2>&1 &
  local pid=$!
  echo "$pid" >"$dir/broker.pid"

  if [ -n "${TIERFLOW_KAFKA_OWNER_PID:-}" ]; then
    # The watchdog: once the owner is gone (even by SIGKILL, which runs no clean-up), stop the
    # broker; once the broker is gone, stop watching.
    (
      trap '' HUP INT
      while alive "$TIERFLOW_KAFKA_OWNER_PID" && alive "$pid"; do sleep 1; done
      if alive "$pid"; then
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 "${KAFKA_STOP_TIMEOUT:-20}"); do alive "$pid" || exit 0; sleep 1; done
        kill -KILL "$pid" 2>/dev/null || true
      fi
    ) </dev/null >/dev/null 2>&1 &
    echo "$!" >"$dir/watchdog.pid"
  fi

  local deadline=$((SECONDS + ${KAFKA_START_TIMEOUT:-90}))
  until grep -q "Kafka Server started" "$dir/broker.log"; do
    if ! alive "$pid"; then
      tail -n 40 "$dir/broker.log" >&2
      die "the broker exited during start-up (log: $dir/broker.log)"
    fi
    if [ "$SECONDS" -ge "$deadline" ]; then
      tail -n 40 "$dir/broker.log" >&2
      stop "$dir" || true
      die "the broker did not start within ${KAFKA_START_TIMEOUT:-90} s (log: $dir/broker.log)"
    fi
    sleep 0.2
  done
  echo "kafka.sh: broker $KAFKA_VERSION on 127.0.0.1:$port (pid $pid, data $dir)" >&2
}

stop() {
  local dir=${1:?usage: kafka.sh stop DIR}
  local pid watchdog
  pid=$(cat "$dir/broker.pid" 2>/dev/null || true)
  watchdog=$(cat "$dir/watchdog.pid" 2>/dev/null || true)
  if alive "$watchdog"; then kill -TERM "$watchdog" 2>/dev/null || true; fi
  if alive "$pid"; then
    kill -TERM "$pid" 2>/dev/null || true
    local deadline=$((SECONDS + ${KAFKA_STOP_TIMEOUT:-20}))
    while alive "$pid" && [ "$SECONDS" -lt "$deadline" ]; do sleep 0.2; done
    if alive "$pid"; then
      echo "kafka.sh: broker $pid ignored SIGTERM for ${KAFKA_STOP_TIMEOUT:-20} s; SIGKILL" >&2
      kill -KILL "$pid" 2>/dev/null || true
      while alive "$pid"; do sleep 0.1; done
    fi
  fi
  rm -f "$dir/broker.pid" "$dir/watchdog.pid"
}

case "${1:-}" in
  fetch) fetch ;;
  fetched) [ -f "$libs/.complete" ] ;;
  start) shift && start "$@" ;;
  stop) shift && stop "$@" ;;
  *) die "usage: kafka.sh fetch | fetched | start DIR PORT [CONTROLLER_PORT] | stop DIR" ;;
esac
