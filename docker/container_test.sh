#!/usr/bin/env bash
# make container-test: build the image's CPU variant from the Dockerfile with buildah, then use it here.
# No Docker engine and no registry: the base image is made from Debian packages (docs/container.md,
# "The CPU variant, built and run here").
#
#   1. the base image BASE_IMAGE (Debian 12 minbase, debootstrap), unless it is already in buildah's store;
#   2. `buildah bud` of the Dockerfile with the CPU build args, from scratch (every step runs, as in a
#      user's first build), with this machine's pip configuration mounted in (docker/host_pip_config.py);
#   3. in the image, as its user: docker/verify_stack.py against the pins and the prebuilt op, then
#      `make demo`'s job (launch/quickstart.py) training through the image's entry point (`train`, 2 CPU
#      ranks, the real deepspeed launcher, ZeRO-3, 300 steps), exporting and evaluating; its result line
#      is printed, and its error must be below chance (the model learnt in the image);
#   4. the image's size and the build time.
#
# Needs root (debootstrap, buildah's chroot isolation): elsewhere it says why and exits 1.
# Environment:
#   DEBIAN_MIRROR   where debootstrap gets Debian 12 (default: the Debian archive of this machine's apt
#                   sources, docker/apt_mirror.sh; printed either way)
#   LAYERS=1        cache each build step: a later run rebuilds from the first changed step only
#                   (for work on the Dockerfile; committing every layer makes a full build ~2 min longer)
#   TORCH_INDEX_URL where the image's torch CPU build comes from (default: this machine's pip config;
#                   elsewhere PyTorch's CPU index, docs/container.md)
#   BASE_IMAGE, IMAGE  image names (default localhost/ntil-base:debian12-minbase, localhost/ntil-ds:cpu)
set -euo pipefail
cd "$(dirname "$0")/.."

BASE_IMAGE="${BASE_IMAGE:-localhost/ntil-base:debian12-minbase}"
IMAGE="${IMAGE:-localhost/ntil-ds:cpu}"
LAYERS="${LAYERS:-0}"
# The base image's Debian comes from where this machine's apt gets its packages (no host is written here).
if [[ -n "${DEBIAN_MIRROR:-}" ]]; then
    mirror_from="DEBIAN_MIRROR"
else
    # shellcheck source=docker/apt_mirror.sh
    source docker/apt_mirror.sh
    if found="$(apt_mirror)"; then
        DEBIAN_MIRROR="${found%%$'\t'*}"
        mirror_from="${found#*$'\t'}"
    fi
fi
# chroot: RUN steps need no OCI runtime or network namespace (the build uses the host's network).
export BUILDAH_ISOLATION=chroot

say() { echo "container-test: $*"; }
fail() {
    echo "container-test: $*" >&2
    exit 1
}

# --- can buildah run here? -------------------------------------------------------------------------
if [[ "$(id -u)" != 0 ]]; then
    fail "needs root: debootstrap makes the base image's files as root, and buildah's chroot builds run" \
        "as root (rootless buildah needs user namespaces and /etc/subuid ranges). Run it as root."
fi
for tool in buildah debootstrap python3; do
    command -v "$tool" >/dev/null \
        || fail "$tool not found: make container-deps installs it (Debian: apt-get install buildah debootstrap)"
done
if ! unshare --mount true 2>/dev/null; then
    fail "cannot create a mount namespace (unshare --mount): buildah's chroot isolation needs" \
        "CAP_SYS_ADMIN; inside a container, run it privileged or on the host"
fi

work="$(mktemp -d /var/tmp/ntil-container-test.XXXXXX)"
container=""
cleanup() {
    if [[ -n "$container" ]]; then buildah rm "$container" >/dev/null || true; fi
    rm -rf "$work"
}
trap cleanup EXIT

# --- 1. the base image ------------------------------------------------------------------------------
base_seconds=0
if buildah inspect --type image "$BASE_IMAGE" >/dev/null 2>&1; then
    say "base image $BASE_IMAGE: present"
else
    [[ -n "${DEBIAN_MIRROR:-}" ]] \
        || fail "no Debian archive in this machine's apt sources (/etc/apt/sources.list," \
            "/etc/apt/sources.list.d/*.list, *.sources) for debootstrap: give one, DEBIAN_MIRROR=<URL of a" \
            "Debian 12 mirror> make container-test (docs/container.md)"
    say "Debian mirror: $DEBIAN_MIRROR (from $mirror_from; DEBIAN_MIRROR=<URL> to use another)"
    say "base image $BASE_IMAGE: making it (debootstrap --variant=minbase bookworm, $DEBIAN_MIRROR)"
    started=$SECONDS
    debootstrap --variant=minbase bookworm "$work/rootfs" "$DEBIAN_MIRROR" >"$work/debootstrap.log" 2>&1 \
        || fail "debootstrap failed; its log: $(tail -n 20 "$work/debootstrap.log")"
    base_container="$(buildah from scratch)"
    base_root="$(buildah mount "$base_container")"
    # A runtime provides /dev, /proc and /sys; apt's caches would only make the image bigger (the
    # Dockerfile runs apt-get update itself).
    tar -C "$work/rootfs" --exclude='./dev/*' --exclude='./proc/*' --exclude='./sys/*' \
        --exclude='./var/cache/apt/archives/*.deb' --exclude='./var/lib/apt/lists/*' -c . \
        | tar -C "$base_root" -x
    # As in Debian's and Ubuntu's own images: apt keeps no .deb files and fetches no translations.
    cat >"$base_root/etc/apt/apt.conf.d/docker-clean" <<'EOF'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
EOF
    echo 'Acquire::Languages "none";' >"$base_root/etc/apt/apt.conf.d/docker-no-languages"
    buildah umount "$base_container" >/dev/null
    buildah config --cmd bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        --label "org.opencontainers.image.description=Debian 12 minbase for ntil-ds's CPU image" \
        "$base_container"
    buildah commit --quiet --rm "$base_container" "$BASE_IMAGE" >/dev/null
    rm -rf "$work/rootfs"
    base_seconds=$((SECONDS - started))
    say "base image $BASE_IMAGE: made in ${base_seconds} s"
fi

# --- 2. the CPU variant -----------------------------------------------------------------------------
mapfile -t pip_mounts < <(python3 docker/host_pip_config.py "$work/pip")
volumes=()
for mount in "${pip_mounts[@]}"; do volumes+=(--volume "$mount"); done
say "this machine's pip settings, mounted into the build: $(grep -v '^#' "$work/pip/pip.conf" | tr '\n' ' ')"

# Build args only: the same stages, files, entry point, user and layout as the CUDA image.
build_args=(
    --build-arg "BUILD_BASE=$BASE_IMAGE"
    --build-arg "RUNTIME_BASE=$BASE_IMAGE"
    --build-arg PYTHON=python3.11
    --build-arg CUDA_VERSION=none
    --build-arg DS_ACCELERATOR=cpu
    --build-arg DS_BUILD_FUSED_ADAM=0
    --build-arg DS_BUILD_CPU_ADAM=0
    --build-arg DS_BUILD_SHM_COMM=1
    --build-arg CUDA_KERNELS=0
    --build-arg "TORCH_INDEX_URL=${TORCH_INDEX_URL:-}"
)
say "building $IMAGE"
previous_image="$(buildah images --no-trunc --noheading --format '{{.ID}}' "$IMAGE" 2>/dev/null || true)"
started=$SECONDS
# --format docker: in buildah's default OCI format the Dockerfile's SHELL is dropped and RUN runs /bin/sh.
# Each step's line gets the seconds since the build started, so a slow step shows in the log.
layers=(--layers=false)
if [[ "$LAYERS" == 1 ]]; then layers=(--layers); fi
buildah bud --format docker "${layers[@]}" --force-rm --pull=never --tag "$IMAGE" "${build_args[@]}" \
    "${volumes[@]}" --file Dockerfile . 2>&1 \
    | while IFS= read -r line; do
        if [[ "$line" == *"] STEP "* || "$line" == *"] COMMIT"* ]]; then
            line="[$((SECONDS - started)) s] $line"
        fi
        printf '%s\n' "$line"
    done \
    || fail "the build of $IMAGE failed (see above)"
build_seconds=$((SECONDS - started))
# The last run's image lost its name to this one: drop it rather than keep 2.5 GB nobody can name.
if [[ -n "$previous_image" && "$previous_image" != "$(buildah images --no-trunc --noheading \
    --format '{{.ID}}' "$IMAGE")" ]]; then
    buildah rmi "$previous_image" >/dev/null 2>&1 || true
fi

# --- 3. in the image ----------------------------------------------------------------------------------
container="$(buildah from --pull=never "$IMAGE")"
in_image() { buildah run "$container" -- "$@"; }
entrypoint="$(buildah inspect --type image --format '{{range .Docker.Config.Entrypoint}}{{.}} {{end}}' \
    "$IMAGE")"
entrypoint="${entrypoint% }"
user="$(buildah inspect --type image --format '{{.Docker.Config.User}}' "$IMAGE")"
say "in the image, as user $user ($(in_image id -un)), entry point: $entrypoint"

in_image python docker/verify_stack.py --pins constraints/cpu.txt constraints/cuda.txt \
    --require torch deepspeed transformers accelerate mlflow bitsandbytes \
    --all-pinned-except pip ntil-ds --cuda none \
    --deepspeed-accelerator cpu --deepspeed-ops deepspeed_shm_comm \
    --import ntil_ds deepspeed.ops.comm.deepspeed_shm_comm_op \
    || fail "the image's packages differ from the pins (see above)"

started=$SECONDS
in_image python launch/quickstart.py --entrypoint "$entrypoint" --out outputs/container-test 2>&1 \
    | tee "$work/demo.log" || fail "the demo failed in the image (see above)"
demo_seconds=$((SECONDS - started))
result="$(grep '^answers that parse:' "$work/demo.log")" || fail "the demo printed no result line"
# "... abs_error: 9.8 (chance: 33, ...)": the demo's 300 steps land far below chance (docs/results.md).
if [[ ! "$result" =~ abs_error:\ ([0-9.]+)\ \(chance:\ ([0-9.]+) ]] \
    || ! awk -v error="${BASH_REMATCH[1]}" -v chance="${BASH_REMATCH[2]}" \
        'BEGIN { exit !(error < chance) }'; then
    fail "the demo did not learn in the image (its error is not below chance): $result"
fi

# --- 4. what it cost -----------------------------------------------------------------------------------
size="$(buildah images --format '{{.Size}}' "$IMAGE")"
say "demo in the image (${demo_seconds} s): $result"
say "image $IMAGE: $size; built in ${build_seconds} s (base image: $(
    if ((base_seconds)); then echo "made in ${base_seconds} s"; else echo present; fi))"
