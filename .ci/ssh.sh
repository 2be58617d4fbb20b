#!/usr/bin/env bash
# sshd on 127.0.0.1:2222 for the `ray up` (cluster launcher) end-to-end test.
#
#   bash .ci/ssh.sh          # from the activated venv qkgeom is installed in (or set QKGEOM_VENV)
#
# Idempotent. Installs openssh-server, rsync and netcat-openbsd (Debian) when missing,
# creates the key ~/.ssh/qkgeom_ci_ed25519 (the path cluster/local.yaml names), and runs a
# private sshd (config, host key, pid file and authorized_keys under $QKGEOM_SSHD_DIR,
# default /tmp/qkgeom-sshd; ~/.ssh/authorized_keys is not touched) that accepts only that
# key, only on 127.0.0.1 (it also sets QKGEOM_VENV in every session; cluster/local.yaml no
# longer reads it: its node environment is ~/qkgeom-venv, see .ci/node-venv.sh).
# Stop it with: kill "$(cat /tmp/qkgeom-sshd/sshd.pid)"
# Progress goes to stderr; the last line on stdout is an export line (for eval).
set -euo pipefail

dir=${QKGEOM_SSHD_DIR:-/tmp/qkgeom-sshd}
port=${QKGEOM_SSH_PORT:-2222}
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${QKGEOM_VENV:-${VIRTUAL_ENV:-$repo/.venv}}
key="$HOME/.ssh/qkgeom_ci_ed25519"
log() { echo "ssh.sh: $*" >&2; }

need=()
[ -x /usr/sbin/sshd ] || need+=(openssh-server)
command -v ssh >/dev/null 2>&1 || need+=(openssh-client)
command -v rsync >/dev/null 2>&1 || need+=(rsync)
command -v nc >/dev/null 2>&1 || need+=(netcat-openbsd)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]} (apt-get)"
  export DEBIAN_FRONTEND=noninteractive
  (apt-get install -y -q "${need[@]}" >&2) || (apt-get update -q >&2 && apt-get install -y -q "${need[@]}" >&2)
fi
[ -x "$venv/bin/qkgeom" ] || log "warning: $venv/bin/qkgeom not found; set QKGEOM_VENV"

mkdir -p "$HOME/.ssh" "$dir" /run/sshd
chmod 700 "$HOME/.ssh" "$dir"
[ -f "$key" ] || ssh-keygen -q -t ed25519 -N "" -C qkgeom-ci -f "$key"
[ -f "$dir/host_ed25519" ] || ssh-keygen -q -t ed25519 -N "" -f "$dir/host_ed25519"
cp "$key.pub" "$dir/authorized_keys"
chmod 600 "$dir/authorized_keys"

cat >"$dir/sshd_config.new" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $dir/host_ed25519
PidFile $dir/sshd.pid
AuthorizedKeysFile $dir/authorized_keys
PermitRootLogin prohibit-password
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
StrictModes no
UsePAM no
AllowTcpForwarding yes
SetEnv QKGEOM_VENV=$venv
Subsystem sftp internal-sftp
EOF

running() { [ -f "$dir/sshd.pid" ] && kill -0 "$(cat "$dir/sshd.pid")" 2>/dev/null; }
if running && cmp -s "$dir/sshd_config.new" "$dir/sshd_config"; then
  log "reusing sshd on 127.0.0.1:$port (pid $(cat "$dir/sshd.pid"))"
else
  if running; then kill "$(cat "$dir/sshd.pid")"; sleep 0.5; fi
  mv "$dir/sshd_config.new" "$dir/sshd_config"
  /usr/sbin/sshd -f "$dir/sshd_config" -E "$dir/sshd.log"
  for _ in $(seq 50); do running && break; sleep 0.1; done
  log "sshd on 127.0.0.1:$port (QKGEOM_VENV=$venv)"
fi
rm -f "$dir/sshd_config.new"
ssh -q -i "$key" -p "$port" -o BatchMode=yes -o StrictHostKeyChecking=no \
  -o UserKnownHostsFile=/dev/null "$(id -un)@127.0.0.1" true \
  || { log "ssh to 127.0.0.1:$port failed; see $dir/sshd.log"; exit 1; }
echo "export QKGEOM_SSH_KEY=$key QKGEOM_SSH_PORT=$port"
