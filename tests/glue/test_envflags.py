"""The one on/off environment parser: every flag vllm-specx reads accepts the same spellings."""

from __future__ import annotations

import pytest

from vllm_specx.cpu_ops import drift
from vllm_specx.envflags import EnvFlagError, env_flag, parse_flag
from vllm_specx.version_gate import SKIP_ENV, check_vllm_version


@pytest.mark.parametrize("value", ["1", "true", "TRUE", " yes ", "On"])
def test_on_spellings(value):
    assert parse_flag("X", value) is True


@pytest.mark.parametrize("value", [None, "", "0", "false", "No", "OFF", "  "])
def test_off_spellings(value):
    assert parse_flag("X", value) is False


def test_other_values_are_refused_in_one_line_naming_variable_and_value():
    with pytest.raises(EnvFlagError) as info:
        parse_flag("VLLM_SPECX_CPU_OPS_ALLOW_DRIFT", "ture")
    message = str(info.value)
    assert "\n" not in message
    assert "VLLM_SPECX_CPU_OPS_ALLOW_DRIFT='ture'" in message and "true" in message


@pytest.mark.parametrize("value,expected", [("on", True), ("yes", True), ("off", False)])
def test_every_flag_reader_uses_the_same_parser(value, expected, monkeypatch):
    """The version-gate bypass and the drift bypass used to accept different words."""
    monkeypatch.setenv(SKIP_ENV, value)
    monkeypatch.setenv(drift.ALLOW_DRIFT_ENV, value)
    assert env_flag(SKIP_ENV) is expected
    assert drift.drift_allowed() is expected
    if expected:
        check_vllm_version("0.1.0")  # bypassed: no refusal
    else:
        with pytest.raises(Exception, match="0.1.0"):
            check_vllm_version("0.1.0")
