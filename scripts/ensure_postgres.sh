#!/usr/bin/env bash
# Make sure a PostgreSQL server answers on 127.0.0.1:5432 with trust auth for user postgres (tests use it).
# Uses the running one when it answers; otherwise installs Debian's package and starts a cluster.
set -euo pipefail
HOST=127.0.0.1 PORT=5432

answers() { python3 - "$HOST" "$PORT" <<'PY'
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close()
except OSError:
    sys.exit(1)
PY
}

if answers; then echo "PostgreSQL answers on $HOST:$PORT"; exit 0; fi

SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO=sudo; else echo "need root (or sudo) to install PostgreSQL" >&2; exit 1; fi
fi
if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
  echo "installing PostgreSQL (Debian package)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq postgresql >/dev/null
fi
ver=$(ls /etc/postgresql | sort -V | tail -1)
hba=/etc/postgresql/$ver/main/pg_hba.conf
if ! $SUDO grep -q "memplan-tests" "$hba"; then
  # Trust loopback connections for the test user, like the project's development machines.
  $SUDO sed -i '1i host all all 127.0.0.1/32 trust # memplan-tests\nhost all all ::1/128 trust # memplan-tests' "$hba"
fi
$SUDO pg_ctlcluster --skip-systemctl-redirect "$ver" main start || $SUDO pg_ctlcluster --skip-systemctl-redirect "$ver" main reload
for _ in $(seq 1 60); do answers && { echo "PostgreSQL $ver started"; exit 0; }; sleep 0.5; done
echo "PostgreSQL did not come up on $HOST:$PORT" >&2
exit 1
