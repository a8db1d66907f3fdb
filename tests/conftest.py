import pytest

from tokenring.tools.launch import RankPool, start_ranks_with

# Ranks fork from a server that imported torch and tokenring once: ~0.05 s per fresh group of ranks instead of
# ~5 s at P=4 (every test that kills or stops a rank needs fresh ones).
start_ranks_with("forkserver", ["torch", "tokenring"])

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


# The quick tier, `pytest -m "not slow"` (the inner loop; CI runs everything): the unit files whole, and from the
# multi-rank files the few tests named in QUICK. Every other test of a file in SLOW_FILES is marked slow here.
SLOW_FILES = {
    "test_any_length.py",
    "test_bench.py",
    "test_calibrate.py",
    "test_comm_and_errors.py",
    "test_compile.py",
    "test_context.py",
    "test_correctness.py",
    "test_decode.py",
    "test_examples.py",
    "test_exit.py",
    "test_extend.py",
    "test_fake_cuda.py",
    "test_families.py",
    "test_fuzz.py",
    "test_generate.py",
    "test_hf.py",
    "test_hierarchical.py",
    "test_launch.py",
    "test_refusals.py",
    "test_testbed.py",
    "test_trainer_matrix.py",
    "test_training.py",
    "test_trl.py",
    "test_varlen.py",
}
QUICK = {
    "test_any_length.py::test_short_lengths_are_exact[3]",
    "test_any_length.py::test_shard_positions_cover_the_sequence_once",
    "test_any_length.py::test_wrong_rows_for_the_length_are_refused",
    "test_correctness.py::test_matches_reference[2-token_ring]",
    "test_correctness.py::test_matches_reference[3-ring]",
    "test_varlen.py::test_packed_and_windowed_match_reference[2]",
    "test_decode.py::test_decode_matches_reference_and_is_identical_on_every_rank[2]",
    "test_hf.py::test_llama_gqa_matches_single_process",
    "test_comm_and_errors.py::test_bad_input_raises_value_error[ranks_differ-different local length]",
    "test_comm_and_errors.py::test_one_rank_refusing_raises_on_every_rank[shape_one_rank-expected 4 dims]",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        name = f"{item.path.name}::{item.nodeid.split('::', 1)[1]}"
        if item.path.name in SLOW_FILES and name not in QUICK:
            item.add_marker(pytest.mark.slow)


# seconds per test file (setup + call + teardown), printed at the end of every run: where the suite's time goes
_file_seconds: dict[str, float] = {}


def pytest_runtest_logreport(report):
    name = report.nodeid.split("::", 1)[0]
    _file_seconds[name] = _file_seconds.get(name, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    if not _file_seconds:
        return
    terminalreporter.write_sep("=", "seconds per file")
    for name, secs in sorted(_file_seconds.items(), key=lambda kv: -kv[1]):
        terminalreporter.write_line(f"{secs:8.1f}  {name}")
    terminalreporter.write_line(f"{sum(_file_seconds.values()):8.1f}  (all files)")
