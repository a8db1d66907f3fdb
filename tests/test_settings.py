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
