#!/bin/sh
# The PostgreSQL binaries the store tests need: `make test`'s `postgres` step (docs/testing.md).
#
# tests/pg.py starts a throw-away server of its own (initdb into a temporary directory, a free
# loopback port), so the tests need only the server binaries initdb and pg_ctl, never a
# database service. In this order:
#   - the binaries tests/pg.py finds ($VOLTRL_PG_BINDIR, which `make test PG_BINDIR=DIR` sets;
#     PATH; pg_config --bindir; /usr/lib/postgresql/*/bin): nothing to do;
#   - PG_INSTALL=no: install nothing (the PostgreSQL store tests then fail and say why);
#   - on Debian/Ubuntu: say what happens, then apt-get install postgresql (with sudo when not
#     root). Debian has no package with only the server binaries: postgresql-NN also creates a
#     "main" cluster and starts it as a system service. The clusters the install created are
#     stopped again and set to start manually (start.conf), so none runs or starts at boot.
set -eu

PYTHON=${PYTHON:-python3}
PG_INSTALL=${PG_INSTALL:-yes}

if [ -n "${VOLTRL_PG_BINDIR:-}" ]; then
    if [ -x "$VOLTRL_PG_BINDIR/initdb" ] && [ -x "$VOLTRL_PG_BINDIR/pg_ctl" ]; then
        echo "PostgreSQL binaries for the store tests: $VOLTRL_PG_BINDIR"
        exit 0
    fi
    echo "PG_BINDIR / VOLTRL_PG_BINDIR: $VOLTRL_PG_BINDIR has no initdb and pg_ctl" >&2
    exit 2
fi
if bindir=$("$PYTHON" tests/pg.py); then
    echo "PostgreSQL binaries for the store tests: $bindir"
    exit 0
fi
if [ "$PG_INSTALL" = no ]; then
    echo "PostgreSQL binaries not found and PG_INSTALL=no: the PostgreSQL store tests will fail" >&2
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "PostgreSQL's server binaries (initdb, pg_ctl) were not found and there is no apt-get" \
        "to install them: install PostgreSQL, then make test PG_BINDIR=/path/to/its/bin" \
        "(or PG_INSTALL=no to run without them)" >&2
    exit 2
fi

SUDO=
if [ "$(id -u)" != 0 ]; then
    SUDO=sudo
fi
cat <<EOF
The store tests need PostgreSQL's server binaries (initdb, pg_ctl) and none were found.
Installing Debian's postgresql package: ${SUDO:+sudo }apt-get update, then apt-get install
postgresql. The package also creates a "main" database cluster and starts it as a system
service; this step stops it again and sets it to start manually, so no database service keeps
running (the tests start a server of their own in a temporary directory).
Instead: make test PG_BINDIR=/path/to/bin (binaries you have) or PG_INSTALL=no (install nothing).
EOF
before=$(ls -d /etc/postgresql/*/*/ 2>/dev/null || true)
$SUDO apt-get update -qq
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql
for dir in /etc/postgresql/*/*/; do
    [ -f "${dir}postgresql.conf" ] || continue
    version=$(basename "$(dirname "$dir")")
    cluster=$(basename "$dir")
    case "$before" in *"$dir"*) continue ;; esac  # a cluster you had: left alone
    $SUDO pg_ctlcluster "$version" "$cluster" stop 2>/dev/null || true
    echo manual | $SUDO tee "${dir}start.conf" >/dev/null
    echo "PostgreSQL cluster $version/$cluster stopped and set to start manually"
done
if [ -d /run/systemd/system ]; then
    $SUDO systemctl daemon-reload
fi
