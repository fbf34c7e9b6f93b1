"""The ``secure`` statistics exchange on the NVFlare side: sums, what the server sees, keys, signatures."""

from __future__ import annotations

import base64
import datetime
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import tenseal as ts

from fedweigh.errors import SimulationKeysRefused
from fedweigh.flare.keys import role_context_provider
from fedweigh.flare.statistics import make_exchange
from fedweigh.histograms import decode_sum, statistics_vector
from fedweigh.secure.contexts import (
    CLIENT_CONTEXT_FILE,
    CONTEXT_DIR_ENV,
    SERVER_CONTEXT_FILE,
    SIMULATION_DIR,
    SIMULATOR_JOB_FOLDER,
    STARTUP_FOLDER,
    load_context,
    make_context,
    save_context_files,
    simulation_keys,
)
from fedweigh.secure.exchange import (
    ENCODING,
    META_CIPHERTEXT,
    META_ENCODING,
    META_LENGTH,
    META_NUM_CONTRIBUTIONS,
    TAG_SLOTS,
    SecureExchange,
)
from fedweigh.secure.stats_release import ReleasedHistogram

NUM_CLASSES = 14
LENGTH = NUM_CLASSES + 2


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("kit")
    save_context_files(directory)
    return directory


@pytest.fixture
def keys_from_env(key_dir, monkeypatch) -> Path:
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(key_dir))
    return key_dir


def exchange(start_dir: Path | None = None) -> SecureExchange:
    """The secure exchange with the keys an NVFlare process in ``start_dir`` (default: cwd) would use."""
    return SecureExchange(role_context_provider(start_dir))


def _site_data(rng: np.random.Generator, sites: int) -> dict[str, tuple[np.ndarray, int]]:
    """Per-site (class counts, N_k) with 7-digit counts no other number in a payload could equal."""
    out = {}
    for k in range(sites):
        n = int(rng.integers(3_000_000, 3_900_000))
        out[f"site-{k + 1}"] = (rng.integers(1_000_000, 2_900_000, size=NUM_CLASSES), n)
    return out


def test_constants_match_nvflare():
    from nvflare.apis.fl_constant import WorkspaceConstants
    from nvflare.lighter.constants import ProvFileName
    from nvflare.private.fed.simulator.simulator_const import SimulatorConstants

    assert SERVER_CONTEXT_FILE == ProvFileName.SERVER_CONTEXT_TENSEAL
    assert CLIENT_CONTEXT_FILE == ProvFileName.CLIENT_CONTEXT_TENSEAL
    assert SIMULATOR_JOB_FOLDER == SimulatorConstants.JOB_NAME
    assert STARTUP_FOLDER == WorkspaceConstants.STARTUP_FOLDER_NAME
    assert isinstance(make_exchange("secure"), SecureExchange)


def test_global_sum_of_16_sites_equals_the_true_sum(keys_from_env):
    rng = np.random.default_rng(3)
    data = _site_data(rng, 16)
    vectors = {site: statistics_vector(counts, n) for site, (counts, n) in data.items()}
    payloads = {site: {META_LENGTH: LENGTH, **exchange().encode(v)} for site, v in vectors.items()}
    server = exchange()
    for site, payload in payloads.items():
        server.check(site, payload, LENGTH)
    total = server.sum(payloads, LENGTH)
    assert total[META_NUM_CONTRIBUTIONS] == 16 and total[META_LENGTH] == LENGTH

    got = decode_sum(exchange().decode(total))
    true = np.sum(list(vectors.values()), axis=0)
    np.testing.assert_array_equal(got.class_counts, true[:NUM_CLASSES].astype(np.int64))
    assert got.num_samples == int(true[-2])
    assert got.client_level_parameter == pytest.approx(true[-1] / true[-2], rel=1e-12)


def test_the_server_object_holds_only_the_public_context(keys_from_env):
    client = exchange()
    payloads = {"site-1": client.encode(np.arange(LENGTH, dtype=float))}
    server = exchange()
    server.check("site-1", payloads["site-1"], LENGTH)
    server.sum(payloads, LENGTH)
    assert list(server.contexts) == ["server"]
    assert not server.contexts["server"].has_secret_key() and server.contexts["server"].is_public()
    assert list(client.contexts) == ["client"] and client.contexts["client"].has_secret_key()


def test_exchange_takes_any_context_provider(key_dir):
    """SecureExchange needs no NVFlare: any ``role -> context`` callable serves, asked once per role."""
    asked: list[str] = []
    files = {"client": CLIENT_CONTEXT_FILE, "server": SERVER_CONTEXT_FILE}

    def provider(role: str) -> ts.Context:
        asked.append(role)
        return load_context(key_dir / files[role], role=role)

    client, server = SecureExchange(provider), SecureExchange(provider)
    payload = client.encode(np.array([1.0, 2.0, 3.0]))
    server.check("site-1", payload, 3)
    total = server.sum({"site-1": payload, "site-2": client.encode(np.array([4.0, 5.0, 6.0]))}, 3)
    assert client.decode(total).tolist() == [5.0, 7.0, 9.0]
    assert asked == ["client", "server"]


def test_server_refuses_a_context_file_with_a_secret_key(tmp_path, monkeypatch):
    ctx = make_context()
    save_context_files(tmp_path, ctx)
    # a mistaken kit: the client file copied over the server's
    (tmp_path / SERVER_CONTEXT_FILE).write_bytes((tmp_path / CLIENT_CONTEXT_FILE).read_bytes())
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(tmp_path))
    payload = {META_LENGTH: 2, META_CIPHERTEXT: "AAAA", META_ENCODING: ENCODING}
    with pytest.raises(ValueError, match="SECRET KEY"):
        exchange().sum({"site-1": payload}, 2)
    with pytest.raises(ValueError, match="SECRET KEY"):
        exchange().check("site-1", payload, 2)


def test_what_the_server_receives_holds_no_plaintext_histogram(keys_from_env, key_dir):
    rng = np.random.default_rng(11)
    (counts, n) = _site_data(rng, 1)["site-1"]
    vector = statistics_vector(counts, n)
    payload = exchange().encode(vector)

    assert set(payload) == {META_CIPHERTEXT, META_ENCODING}
    assert payload[META_ENCODING] == ENCODING
    assert all(isinstance(v, str) for v in payload.values())  # FOBS/JSON-safe, no numbers at all
    raw = base64.b64decode(payload[META_CIPHERTEXT], validate=True)
    assert len(raw) > 1000 * vector.nbytes  # a CKKS ciphertext (~0.2 MB), not 128 bytes of floats
    text = json.dumps(payload)
    for value in [*counts.tolist(), n]:
        assert str(value) not in text
    assert vector.tobytes() not in raw
    # the server's context cannot open it
    server_ctx = load_context(key_dir / SERVER_CONTEXT_FILE, role="server")
    with pytest.raises(ValueError, match="secret_key"):
        ts.ckks_vector_from(server_ctx, raw).decrypt()


def test_check_names_the_site_of_a_malformed_contribution(keys_from_env):
    server = exchange()
    good = exchange().encode(np.ones(LENGTH))
    short = exchange().encode(np.ones(LENGTH - 1))
    cases = [
        ({META_ENCODING: ENCODING}, "site-3: .*non-empty base64"),
        ({**good, META_CIPHERTEXT: "@@not base64@@"}, "site-3: .*not valid base64"),
        ({**good, META_CIPHERTEXT: base64.b64encode(b"junk").decode()}, "site-3: not a CKKS ciphertext"),
        ({**good, META_ENCODING: "plain"}, "site-3: statistics encoding 'plain'"),
        (
            short,
            f"site-3: ciphertext has {2 * (LENGTH - 1 + TAG_SLOTS) + 1} slots, "
            f"expected {2 * (LENGTH + TAG_SLOTS) + 1}",
        ),
    ]
    for payload, message in cases:
        with pytest.raises(ValueError, match=message):
            server.check("site-3", payload, LENGTH)
    server.check("site-3", good, LENGTH)


def test_sites_with_different_keys_get_an_error_not_a_wrong_sum(tmp_path, monkeypatch, keys_from_env):
    other = tmp_path / "other"
    save_context_files(other)
    ours = exchange().encode(np.ones(3))
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(other))
    theirs = exchange().encode(np.ones(3))
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(keys_from_env))
    total = exchange().sum({"site-1": ours, "site-2": theirs}, 3)
    with pytest.raises(ValueError, match="different keys"):
        exchange().decode(total)


def test_simulator_workspace_gets_one_shared_simulation_pair(tmp_path, monkeypatch):
    monkeypatch.delenv(CONTEXT_DIR_ENV, raising=False)
    ws = tmp_path / "ws"
    for site in ("server", "site-1", "site-2"):
        (ws / site / STARTUP_FOLDER).mkdir(parents=True)
        (ws / site / SIMULATOR_JOB_FOLDER / f"app_{site}").mkdir(parents=True)
    vectors = {s: np.array([s == "site-1", 2.0, 5.0]) for s in ("site-1", "site-2")}
    payloads = {s: exchange(ws / s).encode(v) for s, v in vectors.items()}
    total = exchange(ws / "server").sum(payloads, 3)
    out = exchange(ws / "site-2" / SIMULATOR_JOB_FOLDER / "app_site-2").decode(total)
    assert out.tolist() == [1.0, 4.0, 10.0]
    assert (ws / SIMULATION_DIR / SERVER_CONTEXT_FILE).is_file()


def test_simulation_keys_refused_in_a_provisioned_site(tmp_path, monkeypatch):
    sim = simulation_keys(tmp_path / "simws")
    site = tmp_path / "site-1"
    (site / STARTUP_FOLDER).mkdir(parents=True)
    (site / STARTUP_FOLDER / "fed_client.json").write_text("{}")
    monkeypatch.setenv(CONTEXT_DIR_ENV, str(sim))
    with pytest.raises(SimulationKeysRefused, match="provisioned"):
        exchange(site).encode(np.ones(3))


# ------------------------------------------------------------------------------ signed startup kits
def _signed_kit(root: Path, role: str, ctx: ts.Context) -> Path:
    """A startup kit as `nvflare provision` with HEBuilder + SignatureBuilder writes it (own root CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import rsa
    from cryptography.x509.oid import NameOID
    from nvflare.lighter.utils import sign_folders

    startup = root / STARTUP_FOLDER
    startup.mkdir(parents=True)
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test-root-ca")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(now + datetime.timedelta(days=1))
        .sign(key, hashes.SHA256())
    )
    (startup / "rootCA.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (startup / f"fed_{role}.json").write_text("{}")
    save_context_files(startup, ctx)
    sign_folders(str(startup), key, signature_file="signature.json")
    return root


def test_signed_kit_contexts_load_and_tampered_ones_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv(CONTEXT_DIR_ENV, raising=False)
    ctx = make_context()  # one provisioning: one key pair in every kit
    server_site = _signed_kit(tmp_path / "server", "server", ctx)
    client_site = _signed_kit(tmp_path / "site-1", "client", ctx)
    payload = exchange(client_site).encode(np.array([1.0, 2.0]))
    total = exchange(server_site).sum({"site-1": payload, "site-2": payload}, 2)
    assert exchange(client_site).decode(total).tolist() == [2.0, 4.0]

    server_file = server_site / STARTUP_FOLDER / SERVER_CONTEXT_FILE
    save_context_files(tmp_path / "forged")  # someone swaps the server's context after signing
    server_file.write_bytes((tmp_path / "forged" / SERVER_CONTEXT_FILE).read_bytes())
    with pytest.raises(PermissionError, match="invalidSignature"):
        exchange(server_site).sum({"site-1": payload}, 2)

    client_file = client_site / STARTUP_FOLDER / CLIENT_CONTEXT_FILE
    client_file.write_bytes(client_file.read_bytes() + b"\0")
    with pytest.raises(PermissionError, match="invalidSignature"):
        exchange(client_site).encode(np.ones(2))

    signature = client_site / STARTUP_FOLDER / "signature.json"
    signature.unlink()
    with pytest.raises(PermissionError, match="notSigned"):
        exchange(client_site).encode(np.ones(2))


def test_statistics_phase_secure_end_to_end(keys_from_env, tmp_path, monkeypatch):
    """The lead's two-step phase with a stand-in controller: every result the server gets is recorded."""
    from nvflare.app_common.abstract.fl_model import FLModel

    from fedweigh.flare.statistics import answer_statistics_task, run_statistics_phase

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(5)
    data = _site_data(rng, 4)
    trainers = {
        site: SimpleNamespace(
            class_counts=counts,
            num_train=n,
            released_statistics=lambda counts=counts, n=n: ReleasedHistogram(
                np.asarray(counts), n, None, None
            ),
            job_id="job",
            site_name=site,
            global_stats=None,
        )
        for site, (counts, n) in data.items()
    }
    received: list[FLModel] = []

    class Controller:
        def ask_sites(self, task_name, data, targets, min_responses):
            results = []
            for site in targets:
                result = answer_statistics_task(
                    trainers[site], FLModel(params=data.params, meta=dict(data.meta))
                )
                result.meta = {**(result.meta or {}), "client_name": site}
                received.append(result)
                results.append(result)
            return results

        def info(self, msg):
            pass

        def warning(self, msg):
            raise AssertionError(f"unexpected warning: {msg}")

    run_statistics_phase(Controller(), sorted(trainers), "secure")

    true_counts = np.sum([c for c, _ in data.values()], axis=0)
    true_n = sum(n for _, n in data.values())
    for trainer in trainers.values():
        assert trainer.global_stats.class_counts.tolist() == true_counts.tolist()
        assert trainer.global_stats.num_samples == true_n

    # what the server received: ciphertext text, and as numbers only N_k, the vector length and the
    # fewest contributions the site's policy accepts in a sum (2 by the permissive default here)
    allowed_numbers = {LENGTH, 1, 2} | {n for _, n in data.values()}
    secret_numbers = {int(x) for c, _ in data.values() for x in c} | {int(x) for x in true_counts} | {true_n}
    assert len(received) == 8
    for result in received:
        meta = dict(result.meta or {})
        ciphertext = meta.pop(META_CIPHERTEXT, None)
        if ciphertext is not None:  # opaque: base64 of a CKKS ciphertext of ~0.2 MB
            assert isinstance(ciphertext, str) and len(base64.b64decode(ciphertext, validate=True)) > 100_000
        blob = {"params": result.params or {}, "meta": meta, "metrics": result.metrics or {}}
        text = json.dumps(blob, default=str)
        numbers = [v for part in blob.values() for v in part.values() if isinstance(v, int | float)]
        assert set(numbers) <= allowed_numbers, numbers
        assert not any(str(x) in text for x in secret_numbers)
