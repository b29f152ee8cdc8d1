#include "credstore/scope.h"

#include <array>
#include <string_view>

namespace egress::credstore {

namespace {

constexpr size_t kMaxFieldChars = 64;

bool valid_field_char(char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == '-';
}

bool valid_field_value(std::string_view v) {
    if (v.empty() || v.size() > kMaxFieldChars) {
        return false;
    }
    for (char c : v) {
        if (!valid_field_char(c)) {
            return false;
        }
    }
    return true;
}

// The fields in their fixed order (least to most specific), with their specificity weight.
struct FieldRef {
    const char* name;
    std::string Scope::*member;
    int weight;
};

constexpr std::array<FieldRef, 4> kFields = {{
    {"org", &Scope::org, 1},
    {"project", &Scope::project, 2},
    {"user", &Scope::user, 4},
    {"workflow", &Scope::workflow, 8},
}};

}  // namespace

bool Scope::contains(const Scope& run) const {
    if (org.empty() || org != run.org) {
        return false;
    }
    for (const FieldRef& f : kFields) {
        const std::string& mine = this->*f.member;
        if (!mine.empty() && mine != run.*f.member) {
            return false;
        }
    }
    return true;
}

int Scope::specificity() const {
    int total = 0;
    for (const FieldRef& f : kFields) {
        if (!(this->*f.member).empty()) {
            total += f.weight;
        }
    }
    return total;
}

std::string Scope::to_string() const {
    std::string out;
    for (const FieldRef& f : kFields) {
        const std::string& value = this->*f.member;
        if (value.empty()) {
            continue;
        }
        if (!out.empty()) {
            out += ',';
        }
        out += f.name;
        out += '=';
        out += value;
    }
    return out;
}

Result<bool> Scope::validate() const {
    if (org.empty()) {
        return make_error("scope.org: required");
    }
    for (const FieldRef& f : kFields) {
        const std::string& value = this->*f.member;
        if (!value.empty() && !valid_field_value(value)) {
            return make_error(std::string("scope.") + f.name +
                              ": must be 1..64 characters of [A-Za-z0-9._-]");
        }
    }
    return true;
}

Result<Scope> parse_scope(const std::string& text) {
    Scope scope;
    std::array<bool, kFields.size()> seen{};
    std::string_view rest(text);
    bool more = !rest.empty();
    while (more) {
        const size_t comma = rest.find(',');
        const std::string_view item = rest.substr(0, comma);
        more = comma != std::string_view::npos;
        rest = more ? rest.substr(comma + 1) : std::string_view();
        if (item.empty()) {
            return make_error("scope: empty field in \"" + text + "\"");
        }
        const size_t eq = item.find('=');
        if (eq == std::string_view::npos) {
            return make_error("scope: \"" + std::string(item) + "\" is not field=value");
        }
        const std::string_view key = item.substr(0, eq);
        const std::string_view value = item.substr(eq + 1);
        size_t index = kFields.size();
        for (size_t i = 0; i < kFields.size(); ++i) {
            if (key == kFields[i].name) {
                index = i;
                break;
            }
        }
        if (index == kFields.size()) {
            return make_error("scope: unknown field \"" + std::string(key) +
                              "\" (expected org, project, user or workflow)");
        }
        if (seen[index]) {
            return make_error("scope." + std::string(key) + ": given more than once");
        }
        seen[index] = true;
        if (!valid_field_value(value)) {
            return make_error("scope." + std::string(key) +
                              ": must be 1..64 characters of [A-Za-z0-9._-]");
        }
        scope.*kFields[index].member = std::string(value);
    }
    Result<bool> valid = scope.validate();
    if (!valid) {
        return make_error(valid.error());
    }
    return scope;
}

}  // namespace egress::credstore
