"""tokenring.configure / tokenring.options: one precedence rule (configure > environment > default), checked
values, and the shortcuts (set_timeout, set_topology) that go through it."""

import pytest

import tokenring
from tokenring import settings


def test_precedence(monkeypatch):
    monkeypatch.delenv("TOKENRING_TIMEOUT", raising=False)
    assert tokenring.options()["timeout"] == (300.0, "default")
    monkeypatch.setenv("TOKENRING_TIMEOUT", "42")
    assert tokenring.options()["timeout"] == (42.0, "$TOKENRING_TIMEOUT=42")
    tokenring.configure(timeout=7)
    try:
        assert tokenring.get_timeout() == 7.0 and tokenring.options()["timeout"][1] == "tokenring.configure"
    finally:
        tokenring.configure(timeout=None)
    assert tokenring.get_timeout() == 42.0


def test_bad_values_name_the_setting(monkeypatch):
    with pytest.raises(ValueError, match="positive"):
        tokenring.set_timeout(0)
    with pytest.raises(ValueError, match="no setting 'timout'"):
        tokenring.configure(timout=3)
    with pytest.raises(ValueError, match="cpu_flash"):
        tokenring.configure(cpu_backward="fast")
    with pytest.raises(ValueError):
        tokenring.configure(topology="no-such-box")
    monkeypatch.setenv("TOKENRING_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"\$TOKENRING_TIMEOUT='soon'"):
        tokenring.get_timeout()
    assert all(name not in settings._configured for name in settings.SETTINGS)  # nothing half-applied


def test_environment_readings_keep_their_meaning(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "not-a-number")
    assert settings.get("node_size") == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert settings.get("node_size") == 8
    monkeypatch.setenv("TOKENRING_COMPILE_MERGE", "0")
    assert settings.get("compile_merge") is False
    monkeypatch.setenv("TOKENRING_COMPILE_MERGE", "yes")
    assert settings.get("compile_merge") is True


def test_set_topology_is_the_topology_setting(monkeypatch):
    monkeypatch.delenv("TOKENRING_TOPOLOGY", raising=False)
    tokenring.set_topology("mesh:50mbit")
    try:
        assert tokenring.options()["topology"] == ("mesh:50mbit", "tokenring.configure")
    finally:
        tokenring.set_topology(None)
    assert tokenring.options()["topology"] == (None, "default")


def test_a_setting_on_rank_0_only_runs_or_is_named_on_every_rank(pools):
    """A topology or backward choice set on one rank, after calls the ranks agreed: the next calls run (rank 0
    decides auto for every rank, and a setting changed on one rank no longer makes that rank alone re-agree a
    call the others skip). A node size set on one rank, on a new call signature: a ValueError naming it on every
    rank, within the call. (On a signature the others agreed earlier, a node size set on one rank is the open
    case of a refusal on a cached signature.)"""
    import cases

    for _ in range(2):
        assert pools(4).run(cases.settings_on_rank0_case, "topology", "mesh:300mbit") == ["ok"] * 4
        assert pools(4).run(cases.settings_on_rank0_case, "cpu_backward", "math") == ["ok"] * 4
    for msg in pools(4).run(cases.settings_on_rank0_case, "node_size", 2, 12):
        assert "inner_size (ranks per node)" in msg, msg


@pytest.mark.parametrize("strategy", ["token_ring", "ring", "ulysses"])
def test_check_calls_makes_a_refusal_on_a_cached_signature_a_value_error(pools, strategy):
    """With check_calls on every rank, a rank refusing its input on a signature all ranks verified before reaches
    every rank as a ValueError naming it, within the call, and the group stays usable: the next call equals the
    same call before the refusal, bit for bit. (Without it, the others name the rank in a RuntimeError after the
    timeout: tests/test_comm_and_errors.py.)"""
    import cases

    every = pools(4).run(cases.check_calls_case, strategy)
    for rank, res in enumerate(every):
        assert res["message"] is not None, f"rank {rank} did not raise"
        assert "rank(s) [1] refused" in res["message"] or rank == 1, res["message"]
        assert res["same"], f"rank {rank}: the call after the refusal differs"


def test_check_calls_on_one_rank_only_is_named(pools):
    """check_calls set on rank 0 only, at a new signature: a ValueError naming the setting on every rank (at a
    signature the ranks skip comparing, the ranks would pair an exchange with a schedule)."""
    import cases

    for msg in pools(4).run(cases.settings_on_rank0_case, "check_calls", True, 14):
        assert "check_calls setting is on for rank(s) [0] only" in msg, msg
