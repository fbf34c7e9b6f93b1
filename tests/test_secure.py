"""Encrypted statistics sums (fedweigh.secure.contexts, fedweigh.secure.vectors): exactness, key roles, simulation keys, key lookup."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import numpy as np
import pytest

import fedweigh.secure.contexts as contexts
import fedweigh.secure.vectors as vectors
from fedweigh.errors import ContextNotFoundError, SimulationKeysRefused
from fedweigh.secure.contexts import (
    CLIENT_CONTEXT_FILE,
    CONTEXT_DIR_ENV,
    SERVER_CONTEXT_FILE,
    SIMULATION_DIR,
    SIMULATION_HEADER,
    SIMULATION_MARKER,
    find_site_root,
    is_provisioned,
    is_public,
    is_simulator_site,
    load_context,
    locate_context,
    make_context,
    save_context_files,
    simulation_keys,
)
from fedweigh.secure.vectors import decrypt_vector, encrypt_vector, sum_encrypted


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("keys")
    save_context_files(directory)
    return directory


@pytest.fixture(scope="module")
def server_ctx(key_dir):
    return load_context(key_dir / SERVER_CONTEXT_FILE, role="server")


@pytest.fixture(scope="module")
def client_ctx(key_dir):
    return load_context(key_dir / CLIENT_CONTEXT_FILE, role="client")


def _site_vectors(rng: np.random.Generator, sites: int = 16, classes: int = 14) -> list[np.ndarray]:
    """v_k = [n_k1..n_kC, N_k, N_k c_k] with N_k up to 1e6 and N_k c_k up to ~1e12."""
    out = []
    for _ in range(sites):
        n = int(rng.integers(10, 1_000_001))
        counts = rng.integers(0, n + 1, size=classes)
        n_c = n * float(np.mean((n - counts) / np.maximum(counts, 1)))
        out.append(np.array([*counts, n, n_c], dtype=np.float64))
    return out


# ---------------------------------------------------------------------------------- exact sums
def test_decrypted_sum_of_16_sites_is_exact_after_rounding(server_ctx, client_ctx):
    rng = np.random.default_rng(7)
    vectors = _site_vectors(rng)
    vectors[3][-1] = 0.999e12  # a huge N_k c_k next to small counts must not blur the counts
    vectors[5][:3] = [0, 1, 2]
    ciphertexts = [encrypt_vector(client_ctx, v) for v in vectors]
    total = decrypt_vector(client_ctx, sum_encrypted(server_ctx, ciphertexts), 16, num_contributions=16)
    true = np.sum(vectors, axis=0)
    np.testing.assert_array_equal(np.rint(total[:-1]).astype(np.int64), true[:-1].astype(np.int64))
    assert np.all(np.abs(total[:-1] - true[:-1]) < 1e-6)  # counts come back as integers, not just close
    assert total[-1] == pytest.approx(true[-1], rel=1e-12)


def test_slot_layout_splits_each_entry_at_2_pow_20():
    # x = hi * 2^20 + lo: 3 -> (0, 3); 2^20 + 5 -> (1, 5); 2.5 * 2^20 -> (2, 2^19); then the count slot
    slots = vectors._slots(np.array([3.0, 2**20 + 5.0, 2.5 * 2**20]))
    assert slots == [3.0, 5.0, 2.0**19, 0.0, 1.0, 2.0, 1.0]


def test_single_ciphertext_roundtrip_keeps_fractions_to_the_agreed_precision(client_ctx):
    from fedweigh.secure.precision import DEFAULT_PRECISION_BITS, round_decrypted

    vec = np.array([0.0, 1.0, 123.456789, 5e11 + 0.25])  # 5e11 + 0.25 lies on every grid used here
    data = encrypt_vector(client_ctx, vec)
    out = decrypt_vector(client_ctx, data, 4, num_contributions=1)
    np.testing.assert_array_equal(out, round_decrypted(vec, DEFAULT_PRECISION_BITS))
    finer = decrypt_vector(client_ctx, data, 4, num_contributions=1, precision_bits=20)
    np.testing.assert_array_equal(finer, round_decrypted(vec, 20))
    assert finer[2] != out[2] and abs(finer[2] - vec[2]) <= 2.0**-21


def test_count_slot_detects_wrong_number_of_contributions(server_ctx, client_ctx):
    total = sum_encrypted(server_ctx, [encrypt_vector(client_ctx, [1.0, 2.0])] * 2)
    assert decrypt_vector(client_ctx, total, 2, num_contributions=2).tolist() == [2.0, 4.0]
    with pytest.raises(ValueError, match="forged count slot"):  # in range: the keys match
        decrypt_vector(client_ctx, total, 2, num_contributions=3)
    with pytest.raises(ValueError, match="expected 7 for length 3"):
        decrypt_vector(client_ctx, total, 3, num_contributions=2)


def test_contributions_under_another_key_are_detected(server_ctx, client_ctx):
    stranger = make_context()
    total = sum_encrypted(server_ctx, [encrypt_vector(client_ctx, [5.0]), encrypt_vector(stranger, [7.0])])
    with pytest.raises(ValueError, match="different keys"):
        decrypt_vector(client_ctx, total, 1, num_contributions=2)


def test_encrypt_refuses_bad_vectors(client_ctx):
    with pytest.raises(ValueError, match="NaN"):
        encrypt_vector(client_ctx, [1.0, float("nan")])
    with pytest.raises(ValueError, match="1-D"):
        encrypt_vector(client_ctx, np.ones((2, 2)))
    with pytest.raises(ValueError, match="too large"):
        encrypt_vector(client_ctx, [2.0**51])


def test_sum_refuses_empty_and_mismatched_inputs(server_ctx, client_ctx):
    with pytest.raises(ValueError, match="no ciphertexts"):
        sum_encrypted(server_ctx, [])
    with pytest.raises(ValueError, match="#1 has 5 slots"):
        sum_encrypted(server_ctx, [encrypt_vector(client_ctx, [1.0]), encrypt_vector(client_ctx, [1.0, 2.0])])
    with pytest.raises(ValueError, match="#0 is not a CKKS vector"):
        sum_encrypted(server_ctx, [b"not a ciphertext"])


# ---------------------------------------------------------------------------------- key roles
def test_context_files_have_hebuilder_names_and_roles(key_dir, server_ctx, client_ctx):
    assert sorted(p.name for p in key_dir.iterdir()) == [CLIENT_CONTEXT_FILE, SERVER_CONTEXT_FILE]
    assert (CLIENT_CONTEXT_FILE, SERVER_CONTEXT_FILE) == ("client_context.tenseal", "server_context.tenseal")
    assert is_public(server_ctx) and not server_ctx.has_secret_key() and not server_ctx.is_private()
    assert not is_public(client_ctx) and client_ctx.has_secret_key()
    assert not (key_dir / SERVER_CONTEXT_FILE).read_bytes().startswith(SIMULATION_HEADER)


def test_server_cannot_decrypt_or_encrypt(server_ctx, client_ctx):
    data = encrypt_vector(client_ctx, [42.0])
    with pytest.raises(ValueError, match="secret key"):
        decrypt_vector(server_ctx, data, 1, num_contributions=1)
    with pytest.raises(ValueError, match="secret key"):
        encrypt_vector(server_ctx, [1.0])


def test_server_role_refuses_a_context_with_secret_key(key_dir):
    with pytest.raises(ValueError, match="SECRET KEY") as err:
        load_context(key_dir / CLIENT_CONTEXT_FILE, role="server")
    assert CLIENT_CONTEXT_FILE in str(err.value)
    with pytest.raises(ValueError, match="no secret key"):
        load_context(key_dir / SERVER_CONTEXT_FILE, role="client")


def test_garbage_context_file_is_named(tmp_path):
    bad = tmp_path / SERVER_CONTEXT_FILE
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a TenSEAL context") as err:
        load_context(bad, role="server")
    assert str(bad) in str(err.value)


# ---------------------------------------------------------------------------------- simulation keys
def test_simulation_keys_are_created_once_marked_and_reused(tmp_path):
    folder = simulation_keys(tmp_path)
    assert folder == tmp_path / SIMULATION_DIR
    server_bytes = (folder / SERVER_CONTEXT_FILE).read_bytes()
    client_bytes = (folder / CLIENT_CONTEXT_FILE).read_bytes()
    mtime = (folder / CLIENT_CONTEXT_FILE).stat().st_mtime_ns
    assert server_bytes.startswith(SIMULATION_HEADER) and client_bytes.startswith(SIMULATION_HEADER)
    marker = json.loads((folder / SIMULATION_MARKER).read_text())
    assert marker["purpose"] == "nvflare simulator only"
    assert marker["files"] == [SERVER_CONTEXT_FILE, CLIENT_CONTEXT_FILE]

    assert simulation_keys(tmp_path) == folder
    assert (folder / CLIENT_CONTEXT_FILE).read_bytes() == client_bytes
    assert (folder / CLIENT_CONTEXT_FILE).stat().st_mtime_ns == mtime
    assert sorted(p.name for p in tmp_path.iterdir()) == [SIMULATION_DIR]  # no temporary folders left

    server_ctx = load_context(folder / SERVER_CONTEXT_FILE, role="server")
    client_ctx = load_context(folder / CLIENT_CONTEXT_FILE, role="client")
    total = sum_encrypted(server_ctx, [encrypt_vector(client_ctx, [3.0, 4.0])] * 3)
    assert decrypt_vector(client_ctx, total, 2, num_contributions=3).tolist() == [9.0, 12.0]


def test_simulation_keys_race_loser_adopts_the_winners_pair(tmp_path, monkeypatch):
    """A competitor finishes between our existence check and our rename: we must use its keys."""
    original = contexts.save_context_files
    competitor: dict[str, bytes] = {}

    def save_while_competitor_wins(directory, ctx=None, *, simulation=False):
        if not competitor:
            monkeypatch.setattr(contexts, "save_context_files", original)
            winner = simulation_keys(tmp_path)  # the other process, complete before our rename
            competitor["client"] = (winner / CLIENT_CONTEXT_FILE).read_bytes()
        return original(directory, ctx, simulation=simulation)

    monkeypatch.setattr(contexts, "save_context_files", save_while_competitor_wins)
    folder = simulation_keys(tmp_path)
    assert competitor and (folder / CLIENT_CONTEXT_FILE).read_bytes() == competitor["client"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SIMULATION_DIR]


def test_simulation_keys_concurrent_callers_agree(tmp_path):
    results: list[bytes] = []
    barrier = threading.Barrier(4)

    def worker():
        barrier.wait()
        results.append((simulation_keys(tmp_path) / CLIENT_CONTEXT_FILE).read_bytes())

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 4 and len(set(results)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == [SIMULATION_DIR]


def test_foreign_folder_with_simulation_name_is_not_trusted(tmp_path):
    (tmp_path / SIMULATION_DIR).mkdir()
    (tmp_path / SIMULATION_DIR / "something").write_text("x")
    with pytest.raises(RuntimeError, match=SIMULATION_MARKER):
        simulation_keys(tmp_path)


# ---------------------------------------------------------------------------------- key lookup
def _simulator_workspace(root: Path, sites=("server", "site-1")) -> Path:
    """The layout `nvflare simulator JOB -w root` leaves: root/<site>/{startup,local,simulate_job/app_<site>}."""
    for site in sites:
        (root / site / "startup").mkdir(parents=True)
        (root / site / "local").mkdir()
        (root / site / "simulate_job" / f"app_{site}").mkdir(parents=True)
    (root / "startup").mkdir()
    return root


def _provisioned_site(root: Path, role: str = "client", with_context: bool = False) -> Path:
    startup = root / "startup"
    startup.mkdir(parents=True)
    (startup / f"fed_{role}.json").write_text("{}")
    (startup / "rootCA.pem").write_text("-----BEGIN CERTIFICATE-----\n")
    if with_context:
        save_context_files(startup)
    return root


def test_simulator_server_and_clients_share_one_simulation_pair(tmp_path):
    ws = _simulator_workspace(tmp_path / "ws")
    server = locate_context("server", start=ws / "server", environ={})
    client = locate_context("client", start=ws / "site-1" / "simulate_job" / "app_site-1", environ={})
    assert server.source == client.source == "simulation"
    assert server.simulation and client.simulation and not server.provisioned
    assert server.path == ws / SIMULATION_DIR / SERVER_CONTEXT_FILE
    assert client.path == ws / SIMULATION_DIR / CLIENT_CONTEXT_FILE
    assert (
        is_simulator_site(ws / "site-1") and find_site_root(ws / "site-1" / "simulate_job") == ws / "site-1"
    )


def test_kit_context_is_found_from_the_site_and_from_an_app_folder(tmp_path):
    site = _provisioned_site(tmp_path / "site-1", with_context=True)
    app = site / "3f2a-job" / "app_site-1"
    app.mkdir(parents=True)
    for start in (site, app):
        loc = locate_context("client", start=start, environ={})
        assert (loc.path, loc.source, loc.simulation, loc.provisioned) == (
            site / "startup" / CLIENT_CONTEXT_FILE,
            "kit",
            False,
            True,
        )
    assert is_provisioned(site / "startup") and not is_simulator_site(site)


def test_env_variable_takes_precedence(tmp_path, key_dir):
    site = _provisioned_site(tmp_path / "site-1", with_context=True)
    loc = locate_context("server", start=site, environ={CONTEXT_DIR_ENV: str(key_dir)})
    assert (loc.path, loc.source) == (key_dir / SERVER_CONTEXT_FILE, "env")
    with pytest.raises(ContextNotFoundError, match=f"{CONTEXT_DIR_ENV}=.*does not exist"):
        locate_context("server", start=site, environ={CONTEXT_DIR_ENV: str(tmp_path / "nowhere")})


def test_simulation_keys_are_refused_in_a_provisioned_workspace(tmp_path):
    sim = simulation_keys(tmp_path / "simws")
    site = _provisioned_site(tmp_path / "site-1")
    with pytest.raises(SimulationKeysRefused, match="SIMULATION keys.*provisioned") as err:
        locate_context("client", start=site, environ={CONTEXT_DIR_ENV: str(sim)})
    assert "fed_client.json" in str(err.value) and "HEBuilder" in str(err.value)
    # copied into the kit itself, without the marker file: the header still gives them away
    for name in (SERVER_CONTEXT_FILE, CLIENT_CONTEXT_FILE):
        (site / "startup" / name).write_bytes((sim / name).read_bytes())
    with pytest.raises(SimulationKeysRefused):
        locate_context("server", start=site, environ={})
    # the same files are fine outside a provisioned workspace
    assert locate_context("client", start=tmp_path, environ={CONTEXT_DIR_ENV: str(sim)}).simulation


def test_provisioned_kit_without_context_explains_how_to_provision(tmp_path):
    site = _provisioned_site(tmp_path / "server", role="server")
    (site / "simulate_job").mkdir()  # even a folder with the simulator's job name: a kit is a kit
    with pytest.raises(ContextNotFoundError, match="nvflare poc prepare --he") as err:
        locate_context("server", start=site, environ={})
    assert str(site / "startup") in str(err.value)
    assert not (tmp_path / SIMULATION_DIR).exists()


def test_no_context_anywhere_names_where_it_looked(tmp_path):
    lone = tmp_path / "a" / "b"
    lone.mkdir(parents=True)
    with pytest.raises(ContextNotFoundError) as err:
        locate_context("client", start=lone, environ={})
    msg = str(err.value)
    assert CONTEXT_DIR_ENV in msg and str(lone.resolve()) in msg and CLIENT_CONTEXT_FILE in msg
    # a workspace with an empty startup/ that is not a simulator site is no excuse for simulation keys
    (tmp_path / "site" / "startup").mkdir(parents=True)
    with pytest.raises(ContextNotFoundError, match="not an nvflare simulator site"):
        locate_context("client", start=tmp_path / "site", environ={})
    assert not (tmp_path / SIMULATION_DIR).exists()


def test_locate_rejects_unknown_role(tmp_path):
    with pytest.raises(ValueError, match="role"):
        locate_context("admin", start=tmp_path, environ={})


# The files docs/privacy.md names: any one of them makes a startup/ folder a provisioned kit (a server
# kit has fed_server.json, a site kit fed_client.json, every kit rootCA.pem). Listed here, not taken
# from the module, so that dropping one from the code is noticed.
@pytest.mark.parametrize("marker", ["fed_server.json", "fed_client.json", "rootCA.pem"])
def test_each_kit_file_alone_marks_a_provisioned_workspace(tmp_path, marker):
    sim = simulation_keys(tmp_path / "simws")
    site = tmp_path / "site-1"
    (site / "startup").mkdir(parents=True)
    (site / "simulate_job").mkdir()  # even next to the simulator's job folder
    (site / "startup" / marker).write_text("{}")
    assert is_provisioned(site / "startup")
    assert not is_simulator_site(site)
    with pytest.raises(SimulationKeysRefused, match=f"provisioned workspace.*{marker}"):
        locate_context("client", start=site, environ={CONTEXT_DIR_ENV: str(sim)})
    # no context in the kit: the site is told to provision one instead of getting simulation keys
    with pytest.raises(ContextNotFoundError, match="HEBuilder"):
        locate_context("client", start=site, environ={})
    assert not (tmp_path / SIMULATION_DIR).exists()
