#!/usr/bin/env bash
# Debian packages the transfer engines load at import time (Mooncake TE needs libibverbs and libnuma).
# Installs them when running as root with apt-get; otherwise says what to install and carries on.
set -u
need=()
for pkg in libibverbs1 libnuma1; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${need[*]} (needed by the Mooncake transfer engine)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}") \
    >/dev/null || echo "warning: apt-get could not install ${need[*]}; Mooncake will not import" >&2
else
  echo "note: install ${need[*]} (e.g. sudo apt-get install --no-install-recommends ${need[*]}) so Mooncake can import" >&2
fi
exit 0
