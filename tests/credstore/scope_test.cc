#include "credstore/scope.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace egress::credstore {
namespace {

Scope scope(std::string org, std::string project = "", std::string user = "",
            std::string workflow = "") {
    return Scope{std::move(org), std::move(project), std::move(user), std::move(workflow)};
}

TEST(Scope, ToStringUsesFixedOrderAndOmitsEmptyFields) {
    EXPECT_EQ(scope("acme").to_string(), "org=acme");
    EXPECT_EQ(scope("acme", "web").to_string(), "org=acme,project=web");
    EXPECT_EQ(scope("acme", "", "ana").to_string(), "org=acme,user=ana");
    EXPECT_EQ(scope("acme", "web", "ana", "nightly").to_string(),
              "org=acme,project=web,user=ana,workflow=nightly");
}

TEST(Scope, SpecificityWeightsWorkflowOverUserOverProject) {
    EXPECT_EQ(scope("acme").specificity(), 1);
    EXPECT_EQ(scope("acme", "web").specificity(), 3);
    EXPECT_EQ(scope("acme", "", "ana").specificity(), 5);
    EXPECT_EQ(scope("acme", "", "", "nightly").specificity(), 9);
    EXPECT_EQ(scope("acme", "web", "ana", "nightly").specificity(), 15);
    // A workflow-only secret beats project+user.
    EXPECT_GT(scope("acme", "", "", "nightly").specificity(),
              scope("acme", "web", "ana").specificity());
}

struct ContainsCase {
    Scope secret;
    Scope run;
    bool contains;
};

TEST(Scope, ContainsTable) {
    const Scope run = scope("acme", "web", "ana", "nightly");
    const std::vector<ContainsCase> cases = {
        {scope("acme"), run, true},
        {scope("acme", "web"), run, true},
        {scope("acme", "", "ana"), run, true},
        {scope("acme", "", "", "nightly"), run, true},
        {scope("acme", "web", "ana", "nightly"), run, true},
        {scope("other"), run, false},
        {scope("acme", "api"), run, false},
        {scope("acme", "web", "bob"), run, false},
        {scope("acme", "", "", "daily"), run, false},
        {scope(""), run, false},                       // org is never a wildcard
        {scope("acme", "web"), scope("acme"), false},  // run lacks the project
        {scope("acme"), scope("acme", "", "ana"), true},
    };
    for (const ContainsCase& c : cases) {
        EXPECT_EQ(c.secret.contains(c.run), c.contains)
            << c.secret.to_string() << " contains " << c.run.to_string();
    }
}

TEST(Scope, ValidateNamesTheField) {
    EXPECT_TRUE(scope("acme").validate().ok());
    EXPECT_TRUE(scope("a.c-m_e9", "web", "", "nightly").validate().ok());
    EXPECT_TRUE(scope(std::string(64, 'a')).validate().ok());

    auto missing = scope("", "web").validate();
    ASSERT_FALSE(missing.ok());
    EXPECT_EQ(missing.error(), "scope.org: required");

    auto too_long = scope(std::string(65, 'a')).validate();
    ASSERT_FALSE(too_long.ok());
    EXPECT_NE(too_long.error().find("scope.org"), std::string::npos);

    auto bad_user = scope("acme", "", "a/b").validate();
    ASSERT_FALSE(bad_user.ok());
    EXPECT_NE(bad_user.error().find("scope.user"), std::string::npos);

    auto bad_workflow = scope("acme", "", "", "night ly").validate();
    ASSERT_FALSE(bad_workflow.ok());
    EXPECT_NE(bad_workflow.error().find("scope.workflow"), std::string::npos);
}

TEST(ParseScope, ParsesFieldsInAnyOrder) {
    auto s = parse_scope("org=acme,project=web");
    ASSERT_TRUE(s.ok()) << s.error();
    EXPECT_EQ(*s, scope("acme", "web"));

    auto all = parse_scope("workflow=nightly,user=ana,org=acme,project=web");
    ASSERT_TRUE(all.ok()) << all.error();
    EXPECT_EQ(*all, scope("acme", "web", "ana", "nightly"));
    EXPECT_EQ(parse_scope(all->to_string()).value(), *all);  // round trip
}

struct ParseErrorCase {
    std::string text;
    std::string expected_fragment;
};

TEST(ParseScope, ErrorsTable) {
    const std::vector<ParseErrorCase> cases = {
        {"", "scope.org: required"},
        {"project=web", "scope.org: required"},
        {"org=acme,team=x", "\"team\""},
        {"org=acme,org=other", "scope.org: given more than once"},
        {"org=acme,project=a,project=b", "scope.project: given more than once"},
        {"org=acme,project", "not field=value"},
        {"org=acme,,project=web", "empty field"},
        {"org=acme,", "empty field"},
        {"org=", "scope.org: must be"},
        {"org=acme,user=a b", "scope.user: must be"},
    };
    for (const ParseErrorCase& c : cases) {
        auto r = parse_scope(c.text);
        ASSERT_FALSE(r.ok()) << c.text;
        EXPECT_NE(r.error().find(c.expected_fragment), std::string::npos)
            << c.text << " -> " << r.error();
    }
}

}  // namespace
}  // namespace egress::credstore
