import json
import os

import pytest
from hypothesis import settings

from fedweigh.kernels import pin_cpu_kernels

# The bench and simulator pin their processes' CPU kernels (fedweigh.kernels); the tests that compare
# a run in this process with one in a child process need the same kernels here, set before any kernel runs.
pin_cpu_kernels()

# ---------------------------------------------------------------------------------- test layout
# `make test` runs `pytest -n 2 --dist loadgroup --no-loadscope-reorder`: xdist hands the workers one
# unit at a time, in collection order (sorted below, longest units first, so that the short ones fill in
# at the end). A unit is a whole module (its tests share module fixtures, e.g. the provisioned
# federation of test_poc or the faulty run of test_failures), except in SPREAD_MODULES, where every
# test is a unit of its own, so that the simulator runs spread over both workers. The units are made
# by the scheduler below: pytest-xdist 3.8 cannot group by ``xdist_group`` marks under pytest 9 (it
# renames items through an attribute pytest 9 no longer reads), so the marks would be ignored.
LONG_MODULES = ("test_poc", "test_failures")
SPREAD_MODULES = (
    "test_resume",
    "test_parity_stock_fedavg",
    "test_bench_parity",
    "test_he_simulator",
    "test_simulator_jobs",
)
FIRST_FAST_MODULES = ("test_bench", "test_controller_run", "test_explain", "test_train", "test_privacy")


def _module_of(nodeid: str) -> str:
    return os.path.splitext(os.path.basename(nodeid.split("::", 1)[0]))[0]


def _unit_of(nodeid: str) -> str:
    """The scheduling unit of a test: its module, or itself in a SPREAD module."""
    return nodeid if _module_of(nodeid) in SPREAD_MODULES else nodeid.split("::", 1)[0]


def _order(item: pytest.Item) -> tuple:
    module = _module_of(item.nodeid)
    if module in LONG_MODULES:
        return (0, LONG_MODULES.index(module))
    if module in SPREAD_MODULES and item.get_closest_marker("slow"):
        return (1, SPREAD_MODULES.index(module))
    return (2, FIRST_FAST_MODULES.index(module) if module in FIRST_FAST_MODULES else len(FIRST_FAST_MODULES))


#: fixtures that start a federation (the simulator or provisioned processes): their tests are slow ones
FEDERATION_FIXTURES = ("poc", "faulty_run", "method_run")


def pytest_collection_modifyitems(config, items):
    unmarked = [
        item.nodeid
        for item in items
        if set(getattr(item, "fixturenames", ())) & set(FEDERATION_FIXTURES)
        and not item.get_closest_marker("slow")
    ]
    if unmarked:  # `make test-fast` and the mutation run would start a federation for them
        raise pytest.UsageError(f"tests using {FEDERATION_FIXTURES} must be marked slow: {unmarked}")
    if os.environ.get("FEDWEIGH_MUTATION_RUN"):
        left_out = [item for item in items if item.nodeid.startswith(MUTATION_RUN_LEFT_OUT)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if item not in left_out]
        # a mutant's tests, fastest first (mutmut's own timings), so that one that fails ends the run soon
        if os.path.exists("mutmut-stats.json"):
            with open("mutmut-stats.json") as f:
                duration = json.load(f)["duration_by_test"]
            items.sort(key=lambda item: duration.get(item.nodeid, 0.0))
        return
    if os.environ.get("FEDWEIGH_TEST_ORDER") == "given":  # a mutation run puts the fastest tests first
        return
    order = {id(item): (_order(item), position) for position, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])


def pytest_xdist_make_scheduler(config, log):
    """--dist loadgroup with the units of this layout (see above)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class UnitScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _unit_of(nodeid)

    return UnitScheduling(config, log)


# one OpenMP thread per process: the suite runs three workers on two cores, each starting simulator
# servers and sites, and OpenMP's idle threads spin while they wait for work (a tiny simulator run took 27 s
# of CPU with the default two threads per process, 21.5 s with one). Every result the tests compare across
# processes is computed with one torch thread already (``threads=1``), so no figure changes. Set before any
# test imports torch; the simulator's processes inherit it; a value the caller set is kept.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# the simulator and the data loaders read this; tests keep generated data in one folder outside git
os.environ.setdefault("FEDWEIGH_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache", "test-data"))


@pytest.fixture(scope="module")
def keys():
    """A CKKS key pair as HE sites (secret) and the server (public context only) hold it."""
    from types import SimpleNamespace

    from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context

    secret = make_context()
    public = context_from_bytes(serialize_context(secret, with_secret_key=False), role="server")
    return SimpleNamespace(secret=secret, public=public)


@pytest.fixture
def sim_keys(tmp_path, monkeypatch):
    """Simulation keys (they hold a secret key too) in the environment; the working folder in tmp_path."""
    from fedweigh.secure.contexts import CONTEXT_DIR_ENV, make_context, save_context_files

    ctx = make_context()
    save_context_files(tmp_path / "keys", ctx, simulation=True)
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(tmp_path / "keys"))
    monkeypatch.chdir(tmp_path)
    return ctx


@pytest.fixture
def exact_statistics_policy(tmp_path, monkeypatch):
    """This process's site policy for one test: the simulation default with exact label statistics
    (``statistics_epsilon`` null), for tests that compare what a site reports with the exact figures."""
    from fedweigh.protocol import SITE_POLICY_ENV
    from fedweigh.site.policy import PERMISSIVE_DEFAULT

    policy = tmp_path / "exact_statistics_policy.json"
    policy.write_text(json.dumps({**PERMISSIVE_DEFAULT.as_dict(), "statistics_epsilon": None}))
    monkeypatch.setenv(SITE_POLICY_ENV, str(policy))
    return policy


@pytest.fixture(scope="session")
def simulator():
    """Run a recipe through `nvflare simulator` (as a user would) and return the server's metric rows."""
    from simulation import run_recipe_in_simulator

    return run_recipe_in_simulator


@pytest.fixture(scope="session")
def method_run(tmp_path_factory):
    """``method_run(method) -> (rows, server app dir)``: the method's 3-round tiny SynthCXR job in the
    simulator with 2 sites, run once per session and shared by every test (and xdist worker) that needs it."""
    from simulation import cached_run

    from fedweigh.flare.jobs import _job

    # one folder for the whole session, shared by pytest-xdist workers (their base temps are siblings)
    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "method_runs"

    def run(method: str):
        from simulation import TINY_CLIENT, TINY_ROUNDS

        return cached_run(
            method, lambda: _job(method, TINY_CLIENT, TINY_ROUNDS, 2)(f"tiny_{method}"), root, 2
        )

    return run


# a mutation run (benchmarks/mutation_score.py) tests the package, not the mutation report, which changes
# while the run writes it
collect_ignore = ["test_mutation_score.py"] if os.environ.get("FEDWEIGH_MUTATION_RUN") else []
# ... and leaves out the fast tests that took 5 s or more in mutmut's pass (they start processes, export
# jobs, train a bench cell or a network, run the demo): each mutant of a function they call would run them,
# an hour or more a module on two shared cores. docs/testing.md ("Mutation testing") lists them. The
# property tests of the Holm step-down rule (28 s) stay: they are the reference of bench/stats.holm.
MUTATION_RUN_LEFT_OUT = (
    "tests/test_bench_stats.py::test_cells_scored_in_parallel_give_the_same_numbers",
    "tests/test_jobs_export_cli.py::test_deploy_guide_commands_export_jobs_for_the_shipped_hospitals",
    "tests/test_jobs_export_cli.py::test_bundled_jobs_carry_the_package",
    "tests/test_he_simulator.py::test_plaintext_runs_do_not_load_tenseal",
    "tests/test_engine.py::test_site_workers_are_processes",
    "tests/test_poc.py::test_bundle_export_ships_an_importable_package",
    "tests/test_aggregator.py::test_the_aggregator_is_exported_with_its_options",
    "tests/test_dp_end_to_end.py::test_dp_noise_comes_from_the_operating_system",
    "tests/test_results_tables.py::test_every_table_of_docs_results_is_rebuilt_verbatim_from_its_committed_run",
    "tests/test_cli.py::test_demo_runs_the_feddraw_job_and_prints_the_round_table",
    "tests/test_method_options.py::test_tuning_picks_by_validation_auc_and_never_reads_the_test_set",
    "tests/test_poc.py::test_export_modes_exclude_each_other",
    "tests/test_backbones.py::test_bench_runs_a_method_on_the_network_asked_for[densenet121]",
    "tests/test_bench.py::test_rerun_skips_finished_cells",
    # the tests of test_bench.py's ``smoke`` fixture: their calls take under a second, but the fixture (a
    # smoke bench run, 15 s) is set up again for each mutant that reaches them, once per module visit
    "tests/test_bench.py::test_smoke_",
    "tests/test_augment_option.py::test_augmented_training_sees_augmented_batches",
    "tests/test_io.py::test_every_file_the_package_writes_goes_through_io",
    "tests/test_scenario_file.py::test_a_file_scenario_runs_in_the_bench_under_its_name",
    "tests/test_demo_youden.py::test_demo_says_why_gm_at_youden_is_missing",
)

# Hypothesis: the property tests draw new examples in every run; a mutation run
# (benchmarks/mutation_score.py) sets HYPOTHESIS_PROFILE=mutation so that every mutant meets the same ones
settings.register_profile("mutation", derandomize=True, database=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))
