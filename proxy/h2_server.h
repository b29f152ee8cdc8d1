#pragma once
// HTTP/2 codec for the intercepted client leg (nghttp2 server session). Each stream becomes a
// policy::RequestHead and is served by the shared core (proxy/exchange.h) in its own
// coroutine. Declared in proxy/exchange.h as serve_intercepted_h2(); this header only exists
// so the codec has a home of its own (h2_server.cc). Internal to proxy/.
#include "proxy/exchange.h"
