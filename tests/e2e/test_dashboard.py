"""The live dashboard, rendered by headless Chromium against a real server: the page loads with no
network beyond the server, and its numbers change after traffic."""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
import time

import httpx
from server_fixtures import start_server

from tests.helpers import missing_dependency

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    missing_dependency("needs Debian's chromium (installed by .ci/run)")


def _render(url: str) -> str:
    with tempfile.TemporaryDirectory() as profile:
        out = subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
             "--disable-background-networking", "--disable-component-update", "--disable-sync",
             f"--user-data-dir={profile}", "--virtual-time-budget=4000", "--dump-dom", url],
            capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _value(dom: str, key: str) -> str:
    m = re.search(rf'id="v-{key}">([^<]*)<', dom)
    assert m, dom[:2000]
    return m.group(1)


def test_dashboard_renders_and_updates(llama_path):
    srv = start_server(llama_path, "--max-total-tokens", "20000")
    try:
        before = _render(srv.url("/dashboard"))
        assert "radixlm" in before and re.search(r'id="status">updated ', before), before[-1500:]
        tree_before = int(_value(before, "tree"))
        system = " ".join(f"word{i}" for i in range(120))
        for i in range(4):
            r = httpx.post(srv.url("/generate"), json={"text": system + f" question {i}",
                                                       "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}},
                           timeout=60)
            assert r.status_code == 200
        for _ in range(50):     # scheduler stats trail the responses by a moment
            stats = httpx.get(srv.url("/dashboard/stats"), timeout=10).json()
            if stats["generated_tokens"] >= 32:
                break
            time.sleep(0.1)
        assert stats["prefix_cache_hits"] > 0 and stats["generated_tokens"] >= 32
        after = _render(srv.url("/dashboard"))
        assert int(_value(after, "tree")) > tree_before + 100
        assert "tokens generated" in after and " 0 tokens generated" not in after
    finally:
        srv.stop()
