# A multi-host rig on one machine (sourced by tests/cli_elastic.sh; docs/ELASTIC.md): network namespaces
# as hosts. A hub namespace holds a bridge (and mpirun, which runs there: the "login node"); each host
# namespace is joined to it by a veth pair and has one private address of the test subnet, which exists
# inside the namespaces only. The rsh agent written by netns_up plays ssh: `AGENT HOST CMD` fails with
# 255 ("No route to host") when HOST's link is down, else runs CMD in HOST's namespace under its own
# hostname (unshare --uts) with its own Open MPI session directory. Open MPI runs over TCP restricted
# to the subnet. Everything is removed by netns_down (call it from the test's trap).
#
#   netns_up N            hosts h1 .. hN (addresses $NETNS_NET.1 .. .N); sets NETNS_AGENT, NETNS_MPI_ARGS,
#                         NETNS_HOSTS (h1:S,...; S = $NETNS_SLOTS, default 2); returns 1 (with a message in
#                         NETNS_WHY) when namespaces cannot be made here
#   netns_hub CMD...      runs CMD in the hub namespace
#   netns_link H up|down  takes host H's link up or down (its hub-side end)
#   netns_kill_host H SIG kills every process of host H's namespace except its MPI daemon (the ranks)
#   netns_pids H          the processes in host H's namespace
#   netns_down            kills whatever still runs in the namespaces and removes them

NETNS_NET=10.77.0
NETNS_P=""
netns_up() {
    local n=$1 i
    NETNS_WHY=""
    [ "$(id -u)" = 0 ] || { NETNS_WHY="not root"; return 1; }
    command -v ip > /dev/null && command -v unshare > /dev/null || { NETNS_WHY="iproute2 or unshare missing"; return 1; }
    NETNS_P="tel$$"
    NETNS_DIR=$(mktemp -d)
    if ! ip netns add "${NETNS_P}hub" 2> "$NETNS_DIR/err"; then
        NETNS_WHY="ip netns add: $(cat "$NETNS_DIR/err")"
        rm -rf "$NETNS_DIR"
        NETNS_P=""
        return 1
    fi
    ip -n "${NETNS_P}hub" link set lo up
    ip -n "${NETNS_P}hub" link add br0 type bridge
    ip -n "${NETNS_P}hub" addr add "$NETNS_NET.254/24" dev br0
    ip -n "${NETNS_P}hub" link set br0 up || { NETNS_WHY="cannot make a bridge"; netns_down; return 1; }
    NETNS_HOSTS=""
    for i in $(seq 1 "$n"); do
        ip netns add "${NETNS_P}h$i"
        ip link add "${NETNS_P}h${i}a" type veth peer name "${NETNS_P}h${i}b" || { NETNS_WHY="cannot make a veth pair"; netns_down; return 1; }
        ip link set "${NETNS_P}h${i}a" netns "${NETNS_P}h$i"
        ip link set "${NETNS_P}h${i}b" netns "${NETNS_P}hub"
        ip -n "${NETNS_P}h$i" link set "${NETNS_P}h${i}a" name eth0
        ip -n "${NETNS_P}h$i" addr add "$NETNS_NET.$i/24" dev eth0
        ip -n "${NETNS_P}h$i" link set eth0 up
        ip -n "${NETNS_P}h$i" link set lo up
        ip -n "${NETNS_P}hub" link set "${NETNS_P}h${i}b" master br0
        ip -n "${NETNS_P}hub" link set "${NETNS_P}h${i}b" up
        mkdir -p "$NETNS_DIR/sess/h$i"
        NETNS_HOSTS="$NETNS_HOSTS${NETNS_HOSTS:+,}h$i:${NETNS_SLOTS:-2}"
    done
    NETNS_AGENT="$NETNS_DIR/rsh"
    cat > "$NETNS_AGENT" << EOF
#!/bin/bash
# rsh agent of the netns rig: "rsh [options] HOST CMD..." like ssh
while [ "\${1:0:1}" = "-" ]; do shift; done
host=\$1; shift
case "\$host" in h[0-9]*) i=\${host#h} ;; $NETNS_NET.*) i=\${host#$NETNS_NET.} ;; *) echo "rsh: unknown host \$host" >&2; exit 255 ;; esac
ip -n ${NETNS_P}hub -o link show dev ${NETNS_P}h\${i}b 2> /dev/null | grep -q LOWER_UP \\
    || { echo "ssh: connect to host \$host port 22: No route to host" >&2; exit 255; }
exec ip netns exec ${NETNS_P}h\$i unshare --uts /bin/sh -c 'hostname "\$0"; export OMPI_MCA_orte_tmpdir_base="\$1"; exec /bin/sh -c "\$2"' \\
    "h\$i" "$NETNS_DIR/sess/h\$i" "\$*"
EOF
    chmod +x "$NETNS_AGENT"
    NETNS_MPI_ARGS="--mca btl tcp,self --mca btl_tcp_if_include $NETNS_NET.0/24 --mca oob_tcp_if_include $NETNS_NET.0/24"
    return 0
}
netns_hub() { OMPI_MCA_orte_tmpdir_base="$NETNS_DIR/sess" ip netns exec "${NETNS_P}hub" "$@"; }
netns_link() { ip -n "${NETNS_P}hub" link set "${NETNS_P}h${1#h}b" "$2"; }
netns_pids() { ip netns pids "${NETNS_P}h${1#h}" 2> /dev/null; }
netns_kill_host() {
    local p
    for p in $(netns_pids "$1"); do
        grep -qa '^orted' "/proc/$p/cmdline" 2> /dev/null && continue
        case "$(cat "/proc/$p/comm" 2> /dev/null)" in tera) kill "-$2" "$p" 2> /dev/null ;; esac
    done
}
netns_down() {
    [ -n "$NETNS_P" ] || return 0
    local ns p
    for ns in $(ip netns list 2> /dev/null | awk '{print $1}' | grep "^$NETNS_P"); do
        for p in $(ip netns pids "$ns" 2> /dev/null); do kill -CONT "$p" 2> /dev/null; kill -9 "$p" 2> /dev/null; done
    done
    sleep 0.2
    for ns in $(ip netns list 2> /dev/null | awk '{print $1}' | grep "^$NETNS_P"); do ip netns del "$ns" 2> /dev/null; done
    rm -rf "$NETNS_DIR"
    NETNS_P=""
}
