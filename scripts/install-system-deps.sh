#!/usr/bin/env bash
# Debian packages the transfer engines load at import time (Mooncake TE needs libibverbs and libnuma), and the
# tools the network-namespace tests drive (tests/netns: ip and tc from iproute2, iptables for packet loss).
# Installs them when running as root with apt-get; otherwise says what to install and carries on (the
# namespace tests then skip, printing why).
set -u
need=()
for pkg in libibverbs1 libnuma1 iproute2 iptables; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
[ ${#need[@]} -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "installing ${need[*]} (Mooncake's libraries; ip, tc and iptables for the namespace tests)"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}") \
    >/dev/null || echo "warning: apt-get could not install ${need[*]}; Mooncake may not import, tests/netns skip" >&2
else
  echo "note: install ${need[*]} (e.g. sudo apt-get install --no-install-recommends ${need[*]}) so Mooncake can" \
       "import and tests/netns can run" >&2
fi
exit 0
