#!/bin/sh
# Run a command (as root) with a resolver that refuses at once: torch's TCPStore reverse-resolves every client's
# address in its one server thread, and this VM's DNS drops about every 51st query (a 5 s stall of the store).
# A private mount namespace: the machine's own /etc/resolv.conf is untouched.
#   nodns.sh env PYTHONPATH=. python bench/cluster.py --nodes 1024 --duration 5 --no-latency --procs 2
conf=$(mktemp) && echo "nameserver 127.0.0.1" > "$conf" || exit 1
exec unshare -m --propagation private sh -c 'mount --bind "$0" /etc/resolv.conf && shift && exec "$@"' "$conf" sh "$@"
