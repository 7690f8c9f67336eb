"""The children's CPU environment: threads per scheduler, OpenMP wait policy, tcmalloc preload."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from radixlm.runtime.entrypoints import cpu_env
from radixlm.runtime.entrypoints.cpu_env import cpu_child_env, find_tcmalloc


def args(tp: int = 1, dp: int = 1, device: str = "cpu", disable: bool = False) -> SimpleNamespace:
    return SimpleNamespace(tp_size=tp, dp_size=dp, nnodes=1, device=device, disable_cpu_preload=disable,
                           cpu_fixed_threads=False)


@pytest.fixture
def four_cores(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_env, "available_cores", lambda: 4)
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    lib.write_bytes(b"")
    monkeypatch.setattr(cpu_env, "SYSTEM_LIB_DIRS", (str(tmp_path),))
    return str(lib)


def test_threads_split_over_schedulers_and_spin_by_default(four_cores):
    env, notes = cpu_child_env(args(), {})
    assert env["RADIXLM_NUM_THREADS"] == "4" and "OMP_WAIT_POLICY" not in env
    assert env["LD_PRELOAD"] == four_cores and any("tcmalloc: preloading" in n for n in notes)
    env, _ = cpu_child_env(args(tp=2), {})
    assert env["RADIXLM_NUM_THREADS"] == "2" and "OMP_WAIT_POLICY" not in env
    env, _ = cpu_child_env(args(tp=2, dp=4), {})            # 8 schedulers on 4 cores
    assert env["RADIXLM_NUM_THREADS"] == "1" and env["OMP_WAIT_POLICY"] == "PASSIVE"


def test_user_settings_win(four_cores):
    env, _ = cpu_child_env(args(), {"RADIXLM_NUM_THREADS": "8", "LD_PRELOAD": "/x/liba.so"})
    assert env["RADIXLM_NUM_THREADS"] == "8" and env["OMP_WAIT_POLICY"] == "PASSIVE"   # oversubscribed
    assert env["LD_PRELOAD"] == f"/x/liba.so:{four_cores}"
    env, _ = cpu_child_env(args(), {"OMP_WAIT_POLICY": "ACTIVE", "LD_PRELOAD": four_cores})
    assert env["OMP_WAIT_POLICY"] == "ACTIVE" and env["LD_PRELOAD"] == four_cores


def test_preload_switches(four_cores):
    for a, e in ((args(disable=True), {}), (args(), {"RADIXLM_DISABLE_CPU_PRELOAD": "1"}),
                 (args(device="cuda"), {})):
        env, _ = cpu_child_env(a, e)
        assert "LD_PRELOAD" not in env


def test_missing_tcmalloc_is_reported(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_env, "SYSTEM_LIB_DIRS", (str(tmp_path),))
    assert find_tcmalloc() is None
    env, notes = cpu_child_env(args(), {})
    assert "LD_PRELOAD" not in env and any("not installed" in n for n in notes)
