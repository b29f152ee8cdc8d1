#pragma once
// Secret scopes: org > project > user > workflow. Pure logic.
#include <string>
#include <vector>

#include "common/result.h"

namespace egress::credstore {

/// A scope {org, project?, user?, workflow?}. For a secret, empty fields are wildcards; a
/// run's scope is its full identity. org is required; project, user and workflow may each be
/// empty independently.
struct Scope {
    std::string org;
    std::string project;
    std::string user;
    std::string workflow;

    /// A secret scope contains a run scope when every non-empty field of the secret scope
    /// equals the run's field (org must always be set and equal).
    bool contains(const Scope& run) const;
    /// Number of non-empty fields beyond org, weighted so that workflow > user > project:
    /// workflow 8, user 4, project 2, org 1. Higher is more specific.
    int specificity() const;
    /// "org=acme,project=web" (fields in fixed order, empty ones omitted).
    std::string to_string() const;
    /// Field values: 1..64 chars of [A-Za-z0-9._-]; org required. Errors name the field
    /// ("scope.org: required").
    Result<bool> validate() const;
    bool operator==(const Scope&) const = default;
};

/// Parses "org=acme,project=web" (or the same with repeated --scope flags joined by ',').
Result<Scope> parse_scope(const std::string& text);

}  // namespace egress::credstore
