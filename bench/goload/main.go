// goload: a load client built on Go's standard library (net/http, crypto/tls), the kind of
// client issue 5's reference figures were measured with. bench/peers.sh runs it instead of
// egress-bench with PEERS_CLIENT=go, so the ratios can be read next to those figures: a
// client's own CPU per request is part of every proxied request on a shared machine, and
// egress-bench's is much lower than net/http's, which lowers every proxy's ratio to direct.
//
// It accepts the subset of egress-bench's options and JSON that bench/peers.sh uses:
//
//	goload [--cacert F] [--json] [--duration D | --requests N] [--warmup D] [--connections N]
//	       [--h2 --streams M] [--new-connection] [-H 'Name: value']... [--proxy URL] URL
//	goload [common options] --pairs K --compare 'SIDE A' 'SIDE B'
//
// where a side is "[-H 'Name: value']... [--proxy URL] URL". Keep-alive h1 uses one
// Transport with N connections and N goroutines; h2 uses N Transports (one connection each)
// with M goroutines each; --new-connection turns keep-alive off (CONNECT and a full TLS
// handshake per request: net/http keeps no TLS session cache unless given one).
package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"sort"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

const requestTimeout = 30 * time.Second

type headerList []string

func (h *headerList) String() string     { return strings.Join(*h, ", ") }
func (h *headerList) Set(v string) error { *h = append(*h, v); return nil }

type side struct {
	args    string
	url     string
	proxy   *url.URL
	headers http.Header
}

type options struct {
	cacert      string
	duration    time.Duration
	requests    int64
	warmup      time.Duration
	connections int
	streams     int
	h2          bool
	newConn     bool
	pairs       int
}

type result struct {
	Requests  int64            `json:"requests"`
	Errors    int64            `json:"errors"`
	RPS       float64          `json:"rps"`
	P50us     float64          `json:"p50_us"`
	P90us     float64          `json:"p90_us"`
	P99us     float64          `json:"p99_us"`
	MaxUs     float64          `json:"max_us"`
	Protocols map[string]int64 `json:"protocols"`
	ErrorKind map[string]int64 `json:"error_samples,omitempty"`
	Seconds   float64          `json:"seconds"`
}

// splitWords splits a side's argument string the way a shell would for what peers.sh writes:
// words separated by spaces, single-quoted words kept whole.
func splitWords(s string) ([]string, error) {
	var words []string
	var cur strings.Builder
	inWord, quoted := false, false
	for _, r := range s {
		switch {
		case quoted && r == '\'':
			quoted = false
		case quoted:
			cur.WriteRune(r)
		case r == '\'':
			quoted, inWord = true, true
		case r == ' ' || r == '\t' || r == '\n':
			if inWord {
				words = append(words, cur.String())
				cur.Reset()
				inWord = false
			}
		default:
			cur.WriteRune(r)
			inWord = true
		}
	}
	if quoted {
		return nil, errors.New("unterminated quote in " + s)
	}
	if inWord {
		words = append(words, cur.String())
	}
	return words, nil
}

// parseSide reads "[-H 'Name: value']... [--proxy URL] [URL]"; a side without a URL uses
// defaultURL (the URL given among the common options).
func parseSide(args []string, raw string, defaultURL string) (side, error) {
	fs := flag.NewFlagSet("side", flag.ContinueOnError)
	var hs headerList
	fs.Var(&hs, "H", "request header 'Name: value' (repeatable)")
	proxy := fs.String("proxy", "", "forward proxy URL (CONNECT for https)")
	if err := fs.Parse(args); err != nil {
		return side{}, err
	}
	target := defaultURL
	switch {
	case fs.NArg() == 1:
		target = fs.Arg(0)
	case fs.NArg() > 1:
		return side{}, fmt.Errorf("want one URL, got %q", fs.Args())
	}
	if target == "" {
		return side{}, errors.New("no URL")
	}
	sd := side{args: raw, url: target, headers: http.Header{}}
	for _, h := range hs {
		name, value, ok := strings.Cut(h, ":")
		if !ok {
			return side{}, fmt.Errorf("header %q has no colon", h)
		}
		sd.headers.Add(strings.TrimSpace(name), strings.TrimSpace(value))
	}
	if *proxy != "" {
		u, err := url.Parse(*proxy)
		if err != nil {
			return side{}, err
		}
		sd.proxy = u
	}
	return sd, nil
}

func transport(o *options, sd side, tlsConf *tls.Config, conns int) *http.Transport {
	t := &http.Transport{
		TLSClientConfig:     tlsConf.Clone(),
		MaxIdleConns:        conns,
		MaxIdleConnsPerHost: conns,
		MaxConnsPerHost:     conns,
		DisableCompression:  true,
		DisableKeepAlives:   o.newConn,
		ForceAttemptHTTP2:   o.h2,
	}
	if !o.h2 {
		t.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{} // HTTP/1.1 only
	}
	if sd.proxy != nil {
		t.Proxy = http.ProxyURL(sd.proxy) // userinfo becomes Proxy-Authorization on CONNECT
	}
	return t
}

// run drives one side for warmup + duration (or until `requests` succeeded or failed).
func run(o *options, sd side, tlsConf *tls.Config) result {
	// One client per goroutine; a request that hangs fails after requestTimeout, so a run
	// always ends.
	var clients []*http.Client
	var transports []*http.Transport
	add := func(t *http.Transport, n int) {
		transports = append(transports, t)
		for i := 0; i < n; i++ {
			clients = append(clients, &http.Client{Transport: t, Timeout: requestTimeout})
		}
	}
	if o.h2 {
		for c := 0; c < o.connections; c++ {
			add(transport(o, sd, tlsConf, 1), o.streams)
		}
	} else {
		add(transport(o, sd, tlsConf, o.connections), o.connections)
	}
	defer func() {
		for _, t := range transports {
			t.CloseIdleConnections()
		}
	}()

	var measuring atomic.Bool
	var stop atomic.Bool
	var issued atomic.Int64
	var mu sync.Mutex
	res := result{Protocols: map[string]int64{}, ErrorKind: map[string]int64{}}
	var lat []float64

	// one sends a request: its latency and protocol, or what went wrong ("" for a 200).
	one := func(c *http.Client) (us float64, proto, kind string) {
		req, err := http.NewRequest(http.MethodGet, sd.url, nil)
		if err != nil {
			return 0, "", "request"
		}
		req.Header = sd.headers.Clone()
		t0 := time.Now()
		resp, err := c.Do(req)
		if err != nil {
			return 0, "", "transport"
		}
		_, cerr := io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		us = float64(time.Since(t0).Nanoseconds()) / 1e3
		switch {
		case cerr != nil:
			return us, "", "body"
		case resp.StatusCode != http.StatusOK:
			return us, "", fmt.Sprintf("status_%d", resp.StatusCode)
		}
		return us, resp.Proto, ""
	}

	var wg sync.WaitGroup
	for _, cl := range clients {
		wg.Add(1)
		go func(c *http.Client) {
			defer wg.Done()
			var local []float64
			protos := map[string]int64{}
			kinds := map[string]int64{}
			var errs int64
			for !stop.Load() {
				if o.requests > 0 && measuring.Load() && issued.Add(1) > o.requests {
					break
				}
				us, proto, kind := one(c)
				switch {
				case !measuring.Load(): // warmup, or after the measured window
				case kind != "":
					kinds[kind]++
					errs++
				default:
					local = append(local, us)
					protos[proto]++
				}
			}
			mu.Lock()
			lat = append(lat, local...)
			for k, v := range protos {
				res.Protocols[k] += v
			}
			for k, v := range kinds {
				res.ErrorKind[k] += v
			}
			res.Errors += errs
			mu.Unlock()
		}(cl)
	}
	if o.warmup > 0 {
		time.Sleep(o.warmup)
	}
	start := time.Now()
	measuring.Store(true)
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	limit := o.duration
	if o.requests > 0 && limit <= 0 {
		limit = time.Minute
	}
	select {
	case <-done:
	case <-time.After(limit):
	}
	elapsed := time.Since(start)
	measuring.Store(false) // what completes from now on is not counted
	stop.Store(true)
	<-done

	sort.Float64s(lat)
	res.Requests = int64(len(lat))
	res.Seconds = elapsed.Seconds()
	if res.Seconds > 0 {
		res.RPS = float64(res.Requests) / res.Seconds
	}
	pct := func(p float64) float64 {
		if len(lat) == 0 {
			return 0
		}
		i := int(p * float64(len(lat)-1))
		return lat[i]
	}
	res.P50us, res.P90us, res.P99us = pct(0.50), pct(0.90), pct(0.99)
	if len(lat) > 0 {
		res.MaxUs = lat[len(lat)-1]
	}
	return res
}

func median(xs []float64) float64 {
	if len(xs) == 0 {
		return 0
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

func fail(jsonOut bool, err error) {
	if jsonOut {
		b, _ := json.Marshal(map[string]any{"fatal_error": err.Error(),
			"requests": map[string]int64{"ok": 0, "errors": 0}})
		fmt.Println(string(b))
	}
	fmt.Fprintln(os.Stderr, "goload:", err)
	os.Exit(2)
}

func main() {
	var o options
	var hs headerList
	flag.StringVar(&o.cacert, "cacert", "", "PEM file of CAs to trust (default: system roots)")
	jsonOut := flag.Bool("json", false, "print JSON")
	flag.DurationVar(&o.duration, "duration", 5*time.Second, "measured time per run")
	flag.Int64Var(&o.requests, "requests", 0, "stop after this many requests (bounded by --duration)")
	flag.DurationVar(&o.warmup, "warmup", 0, "unmeasured time before each run")
	flag.IntVar(&o.connections, "connections", 1, "connections (h1: concurrent requests too)")
	flag.IntVar(&o.streams, "streams", 1, "h2: concurrent streams per connection")
	flag.BoolVar(&o.h2, "h2", false, "offer h2 (ALPN) and multiplex --streams per connection")
	flag.BoolVar(&o.newConn, "new-connection", false, "one request per connection")
	flag.IntVar(&o.pairs, "pairs", 3, "--compare: A B pairs")
	flag.Var(&hs, "H", "request header 'Name: value' (repeatable)")
	proxy := flag.String("proxy", "", "forward proxy URL")
	// --compare 'A' 'B' is taken out before flag parsing: side B often starts with "--proxy",
	// which the flag package would read as a flag of its own.
	var compareSides []string
	args := os.Args[1:]
	for i := 0; i < len(args); i++ {
		if args[i] == "--compare" || args[i] == "-compare" {
			if i+2 >= len(args) {
				fmt.Fprintln(os.Stderr, "goload: --compare takes two sides: --compare 'A' 'B'")
				os.Exit(2)
			}
			compareSides = []string{args[i+1], args[i+2]}
			args = append(append([]string{}, args[:i]...), args[i+3:]...)
			break
		}
	}
	// Options may follow the URL (as with egress-bench): parse, set the URL aside, go on.
	var positional []string
	for rest := args; ; {
		flag.CommandLine.Parse(rest) //nolint:errcheck // ExitOnError
		if flag.NArg() == 0 {
			break
		}
		positional = append(positional, flag.Arg(0))
		rest = flag.Args()[1:]
	}
	if len(positional) > 1 {
		fail(*jsonOut, fmt.Errorf("want at most one URL, got %q", positional))
	}
	commonURL := ""
	if len(positional) == 1 {
		commonURL = positional[0]
	}
	if o.connections < 1 || o.streams < 1 || o.pairs < 1 {
		fail(*jsonOut, errors.New("--connections, --streams and --pairs must be at least 1"))
	}

	tlsConf := &tls.Config{}
	if o.cacert != "" {
		pem, err := os.ReadFile(o.cacert)
		if err != nil {
			fail(*jsonOut, err)
		}
		pool := x509.NewCertPool()
		if !pool.AppendCertsFromPEM(pem) {
			fail(*jsonOut, errors.New("no certificate in "+o.cacert))
		}
		tlsConf.RootCAs = pool
	}

	if compareSides == nil {
		var sideArgs []string
		for _, h := range hs {
			sideArgs = append(sideArgs, "-H", h)
		}
		if *proxy != "" {
			sideArgs = append(sideArgs, "--proxy", *proxy)
		}
		sd, err := parseSide(sideArgs, strings.Join(os.Args[1:], " "), commonURL)
		if err != nil {
			fail(*jsonOut, err)
		}
		r := run(&o, sd, tlsConf)
		if *jsonOut {
			b, _ := json.Marshal(map[string]any{
				"requests": map[string]int64{"ok": r.Requests, "errors": r.Errors},
				"rps":      r.RPS, "p50_us": r.P50us, "p99_us": r.P99us, "protocols": r.Protocols,
				"error_samples": r.ErrorKind})
			fmt.Println(string(b))
		} else {
			fmt.Printf("%.1f req/s, %d ok, %d errors, p50 %.0f us, p99 %.0f us, %v %v\n", r.RPS,
				r.Requests, r.Errors, r.P50us, r.P99us, r.Protocols, r.ErrorKind)
		}
		return
	}

	var sides [2]side
	for i, raw := range compareSides {
		words, err := splitWords(raw)
		if err != nil {
			fail(*jsonOut, err)
		}
		if sides[i], err = parseSide(words, raw, commonURL); err != nil {
			fail(*jsonOut, fmt.Errorf("side %c: %w", 'A'+i, err))
		}
	}
	type sideOut struct {
		Args        string   `json:"args"`
		Runs        []result `json:"runs"`
		MedianRPS   float64  `json:"median_rps"`
		MedianP99us float64  `json:"median_p99_us"`
	}
	outs := [2]*sideOut{{Args: sides[0].args}, {Args: sides[1].args}}
	var ratios []float64
	for p := 1; p <= o.pairs; p++ {
		var rps [2]float64
		for i := range sides {
			r := run(&o, sides[i], tlsConf)
			outs[i].Runs = append(outs[i].Runs, r)
			rps[i] = r.RPS
			fmt.Fprintf(os.Stderr, "goload: pair %d %c: %.1f req/s, %d errors\n", p, 'A'+i, r.RPS,
				r.Errors)
		}
		if rps[0] > 0 {
			ratios = append(ratios, rps[1]/rps[0])
		}
	}
	for _, s := range outs {
		var rps, p99 []float64
		for _, r := range s.Runs {
			rps = append(rps, r.RPS)
			p99 = append(p99, r.P99us)
		}
		s.MedianRPS, s.MedianP99us = median(rps), median(p99)
	}
	report := map[string]any{"pairs": o.pairs, "median_ratio": median(ratios), "ratios": ratios,
		"a": outs[0], "b": outs[1], "client": "goload (Go net/http)"}
	if *jsonOut {
		b, _ := json.MarshalIndent(report, "", "  ")
		fmt.Println(string(b))
		return
	}
	fmt.Printf("median A %.1f req/s, median B %.1f req/s, median B/A %.3f\n", outs[0].MedianRPS,
		outs[1].MedianRPS, median(ratios))
}
