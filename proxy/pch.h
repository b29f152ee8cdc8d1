#pragma once
// Precompiled header for proxy/ sources only: Asio, Beast and Asio SSL are the slow part of
// every translation unit here (STYLE.md §4). Never included by policy/, tls/ or credstore/.
#include <boost/asio.hpp>
#include <boost/asio/experimental/awaitable_operators.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/ssl.hpp>
