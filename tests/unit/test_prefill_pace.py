"""PrefillPace: the prompt tokens past which a step admits no further request (--prefill-step-tokens)."""

from __future__ import annotations

import logging

import pytest

from radixlm.runtime.managers.prefill_pace import AUTO, MIN_TOKENS, STEP_SECONDS, UNMEASURED, PrefillPace
from radixlm.runtime.server_args import ServerArgs


def test_fixed_and_off_ignore_timing() -> None:
    for setting, want in ((0, 0), (300, 300)):
        pace = PrefillPace(setting, max_tokens=2048)
        pace.observe(rows=1000, seconds=5.0)
        assert pace.target() == want


def test_auto_takes_the_tokens_of_a_step_time_once_measured() -> None:
    pace = PrefillPace(AUTO, max_tokens=2048)
    assert pace.target() == UNMEASURED
    pace.observe(rows=32, seconds=1.0)                 # too small a step to say anything: ignored
    assert pace.target() == UNMEASURED
    pace.observe(rows=1000, seconds=1000 * STEP_SECONDS / 700)   # 700 tokens per STEP_SECONDS
    assert pace.target() == 640                         # whole multiples of 64
    for _ in range(40):                                 # a CPU 10x faster: capped by the step budget
        pace.observe(rows=1000, seconds=1000 * STEP_SECONDS / 7000)
    assert pace.target() == 2048
    for _ in range(40):                                 # a model 10x slower: never below MIN_TOKENS
        pace.observe(rows=1000, seconds=1000 * STEP_SECONDS / 70)
    assert pace.target() == MIN_TOKENS


def test_auto_logs_its_target_when_it_moves(caplog: pytest.LogCaptureFixture) -> None:
    pace = PrefillPace(AUTO, max_tokens=2048)
    with caplog.at_level(logging.INFO, logger="radixlm.runtime.managers.prefill_pace"):
        pace.observe(rows=1000, seconds=1000 * STEP_SECONDS / 700)
        pace.observe(rows=1000, seconds=1000 * STEP_SECONDS / 800)    # 640 -> 640: quiet
        for _ in range(20):
            pace.observe(rows=1000, seconds=1000 * STEP_SECONDS / 1500)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and "up to 640 prompt tokens" in lines[0] and "up to 1024 prompt tokens" in lines[1], lines
    assert pace.target() == 1472                      # moved on since, by less than half: not logged again


def test_auto_stays_fixed_where_ranks_must_plan_alike() -> None:
    pace = PrefillPace(AUTO, max_tokens=2048, measured=False)
    pace.observe(rows=1000, seconds=0.01)
    assert pace.target() == UNMEASURED
    assert PrefillPace(AUTO, max_tokens=256).target() == 256


def test_bad_setting_is_an_error() -> None:
    with pytest.raises(ValueError, match="--prefill-step-tokens"):
        ServerArgs(prefill_step_tokens=-2).validate()
