# gnuplot script for bench/peers.sh: throughput, latency percentiles and CPU per request, per
# load and proxy.
#   gnuplot -e "datafile='plot.dat'; outfile='peers.svg'; peers='egressd haproxy ...'" peers.gp
# plot.dat (from report.py): one row per load: label, then direct and each peer in the order of
# `peers`: req/s, p50 ms, p99 ms, CPU µs/request; "?" where there is no figure (n/a, failed,
# or direct's CPU).
if (!exists("peers")) peers = "egressd haproxy mitmproxy squid"
n = words(peers)
name(i) = (i == 0 ? "direct" : word(peers, i))
set terminal svg size 1000,1560 dynamic enhanced font "sans,12" background "white"
set output outfile
set datafile missing "?"
set style data histograms
set style histogram clustered gap 1
set style fill solid 0.9 border rgb "#333333"
set boxwidth 0.95
set logscale y
set grid ytics mytics lc rgb "#dddddd"
set key outside right top vertical
set xtics nomirror
set lmargin 12
set rmargin 18
array colors[5] = ["#7f7f7f", "#1f77b4", "#2ca02c", "#ff7f0e", "#d62728"]
set multiplot layout 4,1 title "egressd and other credential-injecting proxies (bench/peers.sh); direct = no proxy"
set title "Throughput, req/s (median of pairs; log scale)"
set ylabel "req/s"
plot for [i=0:n] datafile using 2+4*i:xtic(1) title name(i) lc rgb colors[(i % 5) + 1]
set title "p50 latency, ms (log scale)"
set ylabel "ms"
plot for [i=0:n] datafile using 3+4*i:xtic(1) title name(i) lc rgb colors[(i % 5) + 1]
set title "p99 latency, ms (log scale)"
plot for [i=0:n] datafile using 4+4*i:xtic(1) title name(i) lc rgb colors[(i % 5) + 1]
set title "Proxy CPU per request, µs (utime+stime of its processes ÷ requests it carried; log scale)"
set ylabel "µs"
plot for [i=1:n] datafile using 5+4*i:xtic(1) title name(i) lc rgb colors[(i % 5) + 1]
unset multiplot
