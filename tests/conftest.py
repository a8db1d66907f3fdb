import pytest

from tokenring.tools.launch import RankPool

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def pools():
    """``pools(P)`` -> a RankPool of P gloo ranks, started once per session and shared by all tests."""

    def get(P: int) -> RankPool:
        if P not in _pools:
            _pools[P] = RankPool(P)
        return _pools[P]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()
