#!/usr/bin/env bash
# Makes egressd the only way out of a sandbox: a network namespace joined to the host by a
# veth pair, where TCP to the redirected ports (80, 443 by default) is REDIRECTed to egressd's
# transparent listener and everything else (other ports, UDP, the host's own services, the
# transparent port dialled directly) is dropped. Names resolve only through the namespace's
# hosts file (the --host names, pointing at the veth gateway); any other DNS query is refused
# at once. IPv6 is disabled on the veth pair and inside the namespace: the rules below are
# iptables (IPv4) only, and with IPv6 on, both veth ends get fe80:: addresses through which
# the sandbox could reach any host service bound to [::]. Run as root.
#
#   sandbox-netns.sh up NAME --proxy-port 3129 [--ports 80,443] [--subnet 10.250.0.0]
#                            [--host api.github.com]...
#   sandbox-netns.sh exec NAME -- CMD...   # a command inside, with no proxy variables
#   sandbox-netns.sh down NAME
#
# egressd config for it: listen.transparent = <gateway>:<proxy-port> (printed by `up`), and
# a run with `sources: [<sandbox address>/32]` (or `source_cidrs` in POST /v1/runs).
set -euo pipefail

die() { echo "sandbox-netns: $*" >&2; exit 2; }
usage() { sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 2; }

[ $# -ge 2 ] || usage
cmd=$1; name=$2; shift 2
[[ $name =~ ^[a-z0-9][a-z0-9-]{0,11}$ ]] || die "NAME must be 1-12 of [a-z0-9-]: '$name'"
host_if="v${name}h"           # <= 14 characters (IFNAMSIZ 16)
ns_if="v${name}s"
chain="EGRESSD-${name}"

rules() {  # rules ADD|DELETE: the jumps into this sandbox's chains
    local op=$1
    iptables -t nat -"$op" PREROUTING -i "$host_if" -j "$chain"
    iptables -"$op" INPUT -i "$host_if" -j "$chain"
    iptables -"$op" FORWARD -i "$host_if" -j DROP
    iptables -"$op" FORWARD -o "$host_if" -j DROP
}

case "$cmd" in
up)
    proxy_port=""; ports="80,443"; subnet="10.250.0.0"; hosts=()
    while [ $# -gt 0 ]; do
        case "$1" in
        --proxy-port) proxy_port=$2; shift 2 ;;
        --ports) ports=$2; shift 2 ;;
        --subnet) subnet=$2; shift 2 ;;
        --host) hosts+=("$2"); shift 2 ;;
        *) die "unknown option '$1'" ;;
        esac
    done
    [[ $proxy_port =~ ^[0-9]+$ ]] || die "--proxy-port PORT is required"
    [[ $ports =~ ^[0-9]+(,[0-9]+)*$ ]] || die "--ports must be a comma-separated list of ports"
    [[ $subnet =~ ^([0-9]+)\.([0-9]+)\.([0-9]+)\.([0-9]+)$ ]] || die "--subnet must be an IPv4 /30 base"
    base="${BASH_REMATCH[1]}.${BASH_REMATCH[2]}.${BASH_REMATCH[3]}"
    last=${BASH_REMATCH[4]}
    gw="$base.$((last + 1))"; sandbox="$base.$((last + 2))"
    ip netns list | grep -qw "^$name" && die "namespace '$name' exists (run: $0 down $name)"

    ip netns add "$name"
    ip link add "$host_if" type veth peer name "$ns_if"
    ip link set "$ns_if" netns "$name"
    if [ -d /proc/sys/net/ipv6 ]; then  # a kernel without IPv6 has nothing to disable
        # No IPv6 on either veth end nor anywhere inside: no link-local route around the
        # IPv4-only rules below. Both ends are still down, so no address was assigned yet.
        sysctl -qw "net.ipv6.conf.$host_if.disable_ipv6=1"
        ip netns exec "$name" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 \
            net.ipv6.conf.default.disable_ipv6=1 "net.ipv6.conf.$ns_if.disable_ipv6=1"
    fi
    ip addr add "$gw/30" dev "$host_if"
    ip link set "$host_if" up
    ip netns exec "$name" ip link set lo up
    ip netns exec "$name" ip addr add "$sandbox/30" dev "$ns_if"
    ip netns exec "$name" ip link set "$ns_if" up
    ip netns exec "$name" ip route add default via "$gw"

    # Host side. nat: the redirected ports go to the transparent listener (REDIRECT rewrites
    # the destination to $gw:$proxy_port and records the original one for SO_ORIGINAL_DST).
    iptables -t nat -N "$chain"
    iptables -t nat -A "$chain" -p tcp -m multiport --dports "$ports" \
        -j REDIRECT --to-ports "$proxy_port"
    # filter: only redirected connections reach the host (conntrack state DNAT: dialling the
    # transparent port, the admin port or anything else on $gw directly is dropped); DNS is
    # refused at once so resolvers fail fast instead of timing out.
    iptables -N "$chain"
    iptables -A "$chain" -p tcp --dport "$proxy_port" -m conntrack --ctstate DNAT -j ACCEPT
    iptables -A "$chain" -m conntrack --ctstate ESTABLISHED,RELATED -j ACCEPT
    iptables -A "$chain" -p udp --dport 53 -j REJECT --reject-with icmp-port-unreachable
    iptables -A "$chain" -p tcp --dport 53 -j REJECT --reject-with tcp-reset
    iptables -A "$chain" -j DROP
    rules A

    # Name resolution inside: `ip netns exec` bind-mounts /etc/netns/NAME/* over /etc.
    mkdir -p "/etc/netns/$name"
    {
        echo "127.0.0.1 localhost"
        for h in "${hosts[@]}"; do echo "$gw $h"; done
    } > "/etc/netns/$name/hosts"
    echo "nameserver $gw" > "/etc/netns/$name/resolv.conf"

    cat <<INFO
sandbox '$name' is up: sandbox address $sandbox, gateway $gw
egressd:  listen.transparent: $gw:$proxy_port   and a run with sources: [$sandbox/32]
run:      $0 exec $name -- curl --cacert RUN_CA.pem https://HOST/
          (or: ip netns exec $name CMD; trust the run CA with SSL_CERT_FILE and friends)
remove:   $0 down $name
INFO
    ;;
exec)
    [ "${1:-}" = "--" ] && shift
    [ $# -gt 0 ] || die "exec needs a command"
    exec ip netns exec "$name" env -u HTTPS_PROXY -u HTTP_PROXY -u https_proxy -u http_proxy \
        -u ALL_PROXY -u all_proxy "$@"
    ;;
down)
    rules D 2>/dev/null || true
    iptables -t nat -F "$chain" 2>/dev/null && iptables -t nat -X "$chain" 2>/dev/null || true
    iptables -F "$chain" 2>/dev/null && iptables -X "$chain" 2>/dev/null || true
    ip link del "$host_if" 2>/dev/null || true
    ip netns del "$name" 2>/dev/null || true
    rm -rf "/etc/netns/${name:?}"
    ;;
*) usage ;;
esac
