"""Real clients (curl, Python requests) pointed at egressd the way a sandbox would be."""
from __future__ import annotations

import json

import requests

import helpers


def run_ca(e: helpers.Egressd, run: str | None) -> str:
    """The CA file egressd wrote for `run` (the only run when run is None)."""
    return next(r["ca_cert_out"] for r in e.config["runs"] if run is None or r["id"] == run)


def proxy_env(e: helpers.Egressd, run: str | None, token: str | None, cafile: str | None = None):
    url = e.proxy_url(run, token)
    env = helpers.clean_env(HTTPS_PROXY=url, HTTP_PROXY=url, https_proxy=url, http_proxy=url)
    if cafile:
        env["CURL_CA_BUNDLE"] = cafile
    return env


def curl_via(w, e: helpers.Egressd, url: str, *args: str, run: str | None = "r1",
             token: str | None = None, cafile: str | None = None, timeout: float = 60.0):
    """curl through egressd configured by HTTPS_PROXY/HTTP_PROXY, trusting the run CA."""
    if run is not None and token is None:
        token = w.tokens[run]
    ca = cafile or run_ca(e, run)
    env = proxy_env(e, run, token)
    return helpers.curl(["--cacert", ca, *args, url], env=env, timeout=timeout)


def curl_json(w, e, url, *args, **kw) -> dict:
    r = curl_via(w, e, url, "-f", *args, **kw)
    assert r.returncode == 0, f"curl {url} rc={r.returncode}: {r.stderr.decode(errors='replace')}"
    return json.loads(r.stdout)


def requests_session(w, e: helpers.Egressd, run: str | None = "r1", token: str | None = None,
                     cafile: str | None = None) -> requests.Session:
    """A requests.Session that goes through egressd (explicit proxies, like HTTPS_PROXY)."""
    if run is not None and token is None:
        token = w.tokens[run]
    s = requests.Session()
    s.trust_env = False
    url = e.proxy_url(run, token)
    s.proxies = {"https": url, "http": url}
    s.verify = cafile or run_ca(e, run)
    return s
