#!/usr/bin/env bash
# A Debian 12 (bookworm) base image made locally, for machines that reach Debian's package
# mirror but no image registry (Docker Hub refused): debootstrap a minimal root file system
# and `docker import` it. The Dockerfile's CPU variant starts from it (BASE_IMAGE); its apt
# sources are Debian's, so `apt-get install` works in a build with host networking.
#
#   scripts/docker_base_image.sh [IMAGE]       # default debian:bookworm-local
#
# Needs root, debootstrap (`apt-get install debootstrap`) and a running Docker engine.
# Does nothing if IMAGE exists already (FORCE=1 rebuilds it). MIRROR overrides the mirror
# (default: the first deb.debian.org-style URI of this machine's apt sources, else
# http://deb.debian.org/debian). About 2 minutes on 2 cores; the image is about 120 MB.
set -euo pipefail

IMAGE=${1:-debian:bookworm-local}
SUITE=bookworm
ROOTFS=${ROOTFS:-/srv/rootfs-$SUITE}

if [ "${FORCE:-0}" != 1 ] && docker image inspect "$IMAGE" >/dev/null 2>&1; then
    echo "docker_base_image: $IMAGE exists (FORCE=1 rebuilds it)"
    exit 0
fi

if [ -z "${MIRROR:-}" ]; then
    MIRROR=$(grep -hoE 'https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/*.list \
        /etc/apt/sources.list.d/*.sources 2>/dev/null | head -n1 | tr -d ' ' || true)
    MIRROR=${MIRROR:-http://deb.debian.org/debian}
fi
SECURITY=${SECURITY_MIRROR:-${MIRROR%/debian*}/debian-security}

start=$(date +%s)
rm -rf "$ROOTFS"
echo "docker_base_image: debootstrap $SUITE from $MIRROR into $ROOTFS"
# minbase: essential packages and apt only; ca-certificates for pip's HTTPS later.
debootstrap --variant=minbase --include=ca-certificates "$SUITE" "$ROOTFS" "$MIRROR" \
    >"$ROOTFS.log" 2>&1 || { tail -n 30 "$ROOTFS.log"; exit 1; }

# The apt sources a Debian image has (updates and security too), in deb822 form.
rm -f "$ROOTFS/etc/apt/sources.list"
cat >"$ROOTFS/etc/apt/sources.list.d/debian.sources" <<SOURCES
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: $SECURITY
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SOURCES
# What the official debian images set up for containers: no recommends, no caches kept.
cat >"$ROOTFS/etc/apt/apt.conf.d/docker-local" <<'APT'
APT::Install-Recommends "false";
APT::Install-Suggests "false";
Acquire::Languages "none";
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/*.bin || true"; };
APT
chroot "$ROOTFS" apt-get clean
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/*.bin "$ROOTFS"/var/log/*.log \
    "$ROOTFS"/tmp/* "$ROOTFS"/var/tmp/*
# The host's resolver and hostname are bind-mounted by Docker at run time.
: >"$ROOTFS/etc/resolv.conf"
: >"$ROOTFS/etc/hostname"

tar --numeric-owner -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' \
    --message "debootstrap --variant=minbase $SUITE $MIRROR" \
    - "$IMAGE" >/dev/null
rm -rf "$ROOTFS"
echo "docker_base_image: $IMAGE ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}')) in $(( $(date +%s) - start )) s"
