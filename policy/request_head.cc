#include "policy/request_head.h"

#include <algorithm>

#include "common/secure_zero.h"

namespace egress::policy {

namespace {

char lower_char(char c) {
    return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c;
}

}  // namespace

std::string ascii_lower(std::string_view s) {
    std::string out(s);
    for (char& c : out) {
        c = lower_char(c);
    }
    return out;
}

const std::string* find_header(const std::vector<Header>& headers, std::string_view name) {
    for (const Header& h : headers) {
        if (iequals(h.name, name)) {
            return &h.value;
        }
    }
    return nullptr;
}

const std::string* RequestHead::find(std::string_view name) const {
    return find_header(headers, name);
}

size_t RequestHead::count(std::string_view name) const {
    return static_cast<size_t>(std::count_if(
        headers.begin(), headers.end(), [&](const Header& h) { return iequals(h.name, name); }));
}

size_t RequestHead::remove(std::string_view name) {
    const size_t before = headers.size();
    std::erase_if(headers, [&](const Header& h) { return iequals(h.name, name); });
    return before - headers.size();
}

void RequestHead::set(std::string_view name, std::string value) {
    remove(name);
    headers.push_back(Header{ascii_lower(name), std::move(value)});
}

std::string_view RequestHead::path_only() const {
    std::string_view p = path;
    // Only the query is cut: a '#' has no place in a request target, so it stays part of the
    // path and is seen by every check that runs on it.
    const size_t q = p.find('?');
    return q == std::string_view::npos ? p : p.substr(0, q);
}

void RequestHead::wipe_injected() {
    if (never_index.empty()) {
        return;
    }
    for (Header& h : headers) {
        if (never_indexed(h.name)) {
            egress::secure_zero(h.value.data(), h.value.size());
        }
    }
}

}  // namespace egress::policy
