"""HE model updates (fedweigh.secure.updates): encrypt -> weighted sum without secret key -> decrypt."""

from __future__ import annotations

import numpy as np
import pytest

from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context
from fedweigh.secure.updates import (
    GLOBAL_PREFIX,
    UPDATE_PREFIX,
    HELayout,
    decode_global,
    decrypt_chunks,
    encode_update,
    encrypt_chunks,
    load_chunks,
    select_encrypted_keys,
    unpack_chunks,
    weighted_sum,
)
from fedweigh.server.encrypted import EncryptedGlobalModel
from fedweigh.server.rounds import ClientResult, RoundStep
from fedweigh.server.safeguards import Safeguards
from fedweigh.weighting import ClientReport, HEIncompatibleScheme, get_scheme, he_capable_schemes
from fedweigh.weighting.base import ScalarContext

TOL = 1e-4  # CKKS (scale 2^40) error is about 1e-7 on values ~0.1; float32 storage adds ~1e-8


@pytest.fixture(scope="module")
def contexts():
    secret = make_context()
    public = context_from_bytes(serialize_context(secret, with_secret_key=False), role="server")
    return secret, public


def small_model(seed: int = 0) -> dict[str, np.ndarray]:
    """A conv + BatchNorm + linear state dict (float32 arrays and one int64 buffer)."""
    rng = np.random.default_rng(seed)
    return {
        "conv.weight": rng.normal(0, 0.1, (8, 1, 3, 3)).astype(np.float32),
        "bn.weight": np.ones(8, np.float32),
        "bn.bias": np.zeros(8, np.float32),
        "bn.running_mean": rng.normal(0, 0.1, 8).astype(np.float32),
        "bn.running_var": np.ones(8, np.float32),
        "bn.num_batches_tracked": np.array(5, dtype=np.int64),
        "fc.weight": rng.normal(0, 0.1, (14, 1200)).astype(np.float32),  # 16800 values: 5 ciphertexts
        "fc.bias": np.zeros(14, np.float32),
    }


def trained(global_params: dict, seed: int, steps: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    out = {}
    for k, v in global_params.items():
        if v.dtype.kind == "f":
            out[k] = (v + rng.normal(0, 0.05, v.shape)).astype(v.dtype)
        else:
            out[k] = v + steps
    return out


def plaintext(scheme_name: str, global_params, sites, reports, round_index, num_rounds, **options):
    """The plaintext path: weights and theta_g + sum_k w_k Delta_k by the scheme's own code."""
    scheme = get_scheme(scheme_name, **options)
    full = [ClientReport(**{**r.__dict__, "params": p}) for r, p in zip(reports, sites, strict=True)]
    w = scheme.weights(full, global_params, round_index, num_rounds)
    return w, scheme.aggregate(global_params, full, w)


def he_round(server: EncryptedGlobalModel, ctx, reference, sites, reports, scheme, t, num_rounds):
    """One HE round as the controller and the client script run it; returns (update, decrypted global)."""
    received = server.task_params()
    global_params, layout = decode_global(ctx, received, server.meta(), reference)
    sent = {r.name: encode_update(ctx, p, global_params, layout) for r, p in zip(reports, sites, strict=True)}
    results = [
        ClientResult(
            r.name,
            sent[r.name],
            {
                "num_samples": r.num_samples,
                "NUM_STEPS_CURRENT_ROUND": r.num_steps,
                "fedweigh_scalars": r.scalars,
            },
        )
        for r in reports
    ]
    # the scheme's own weights, uncapped, as the plaintext path computes them
    update = RoundStep(scheme, server, num_rounds=num_rounds, safeguards=Safeguards(max_share=None)).run(
        t, results
    )
    assert update.updated, update.reason
    new_global, _ = decode_global(ctx, server.task_params(), server.meta(), reference)
    return update, new_global, sent


def max_abs_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max(float(np.abs(np.asarray(a[k], np.float64) - np.asarray(b[k], np.float64)).max()) for k in a)


# --------------------------------------------------------------------------------------- the sum
def test_weighted_sum_of_ciphertexts_equals_plaintext_sum(contexts):
    secret, public = contexts
    rng = np.random.default_rng(0)
    vectors = [rng.normal(0, 0.1, 10_001) for _ in range(3)]
    base = rng.normal(0, 0.5, 10_001)
    layout = HELayout(("x",), ((10_000,),), slots=4096)  # 10_000 values + the check slot
    updates = [load_chunks(public, encrypt_chunks(secret, v), layout, f"s{i}") for i, v in enumerate(vectors)]
    w = [0.2, 0.5, 0.3]
    summed = weighted_sum(updates, w, base)
    assert summed is not None and len(summed) == 3  # 4096 + 4096 + 1809 slots
    # rounded to 2^-20 (the finest precision the sites may agree on) to see the sum's own error
    out = decrypt_chunks(secret, [c.serialize() for c in summed], layout, precision_bits=20)
    expected = base + sum(wk * v for wk, v in zip(w, vectors, strict=True))
    assert np.abs(out - expected).max() < 1e-6
    # a second round adds to the encrypted result (same CKKS level: no level is consumed per round)
    again = weighted_sum([updates[0]], [0.7], summed)
    out2 = decrypt_chunks(secret, [c.serialize() for c in again], layout, precision_bits=20)
    assert np.abs(out2 - (expected + 0.7 * vectors[0])).max() < 1e-6
    # every weight zero: nothing to add, the caller keeps its global model
    assert weighted_sum(updates, [0.0, 0.0, 0.0], base) is None


def test_server_object_holds_no_secret_key_and_cannot_decrypt(contexts):
    secret, public = contexts
    g = small_model()
    server = EncryptedGlobalModel(public, g)
    assert not server.ctx.has_secret_key()
    with pytest.raises(PermissionError, match="SECRET KEY"):
        EncryptedGlobalModel(secret, g)
    chunks = encrypt_chunks(secret, np.ones(10))
    with pytest.raises(ValueError, match="secret key"):
        decrypt_chunks(public, chunks, HELayout(("x",), ((10,),)))
    with pytest.raises(ValueError, match="secret key"):
        encrypt_chunks(public, np.ones(10))


# ------------------------------------------------------------------------------------- full rounds
@pytest.mark.parametrize(
    ("scheme_name", "options", "scalars"),
    [
        ("fedavg", {}, [{}, {}, {}]),
        ("cbr", {}, [{"skew": 0.2}, {"skew": 1.5}, {"skew": 0.7}]),
        ("feddraw", {"beta_max": 2.0}, None),  # similarity computed by each site
    ],
)
def test_two_he_rounds_equal_the_plaintext_path(contexts, scheme_name, options, scalars):
    secret, public = contexts
    g0 = small_model()
    server = EncryptedGlobalModel(public, g0)
    scheme = get_scheme(scheme_name, **options)
    g_plain, g_he = g0, g0
    for t in (1, 2):
        sites = [trained(g_he, 10 * t + k, steps=k + 1) for k in range(3)]
        if scalars is None:  # the site computes FedDRAW's similarity from theta_k and theta_g
            site_scalars = [scheme.client_scalars(ScalarContext(params=p, global_params=g_he)) for p in sites]
            assert all(set(s) == set(scheme.scalars(encrypted=True)) == {"similarity"} for s in site_scalars)
        else:
            site_scalars = scalars
        reports = [
            ClientReport(name=f"site-{k + 1}", num_samples=[30, 50, 120][k], num_steps=k + 1, scalars=s)
            for k, s in enumerate(site_scalars)
        ]
        w_plain, g_plain = plaintext(scheme_name, g_he, sites, reports, t, 2, **options)
        update, g_he, sent = he_round(server, secret, g0, sites, reports, scheme, t, 2)
        assert list(update.weights.values()) == pytest.approx(list(w_plain), abs=1e-12)
        assert max_abs_diff(g_he, g_plain) < TOL
        assert max_abs_diff(g_he, g0) > 100 * TOL  # the models moved: the comparison can fail
        assert g_he["bn.num_batches_tracked"] == g_plain["bn.num_batches_tracked"]
        # what the server received: ciphertext chunks and the integer buffer, no float array in clear
        for payload in sent.values():
            clear = {k for k in payload if not k.startswith(UPDATE_PREFIX)}
            assert clear == {"bn.num_batches_tracked"}
            assert all(v.dtype == np.uint8 for k, v in payload.items() if k.startswith(UPDATE_PREFIX))
    assert server.holds_ciphertext and any(k.startswith(GLOBAL_PREFIX) for k in server.task_params())
    assert {k for k in server.task_params() if not k.startswith(GLOBAL_PREFIX)} == {"bn.num_batches_tracked"}


def test_round_one_sends_the_plaintext_initial_model(contexts):
    secret, public = contexts
    g0 = small_model()
    server = EncryptedGlobalModel(public, g0)
    assert not server.holds_ciphertext and not any(k.startswith(GLOBAL_PREFIX) for k in server.task_params())
    decoded, _ = decode_global(secret, server.task_params(), server.meta(), g0)
    assert max_abs_diff(decoded, g0) == 0.0


def test_selective_layers_encrypt_only_the_chosen_arrays(contexts):
    secret, public = contexts
    g0 = small_model()
    server = EncryptedGlobalModel(public, g0, layers=["fc.*", "first:1"])
    assert server.layout.keys == ("conv.weight", "fc.weight", "fc.bias")
    assert server.layout.num_values == 72 + 16800 + 14
    scheme = get_scheme("fedavg")
    sites = [trained(g0, k, steps=1) for k in range(2)]
    reports = [ClientReport(name=f"s{k}", num_samples=10 * (k + 1)) for k in range(2)]
    w_plain, g_plain = plaintext("fedavg", g0, sites, reports, 1, 3)
    update, g_he, sent = he_round(server, secret, g0, sites, reports, scheme, 1, 3)
    assert max_abs_diff(g_he, g_plain) < TOL
    for payload in sent.values():  # the BatchNorm arrays travel in clear, conv and fc encrypted
        assert {k for k in payload if not k.startswith(UPDATE_PREFIX)} == {
            "bn.weight",
            "bn.bias",
            "bn.running_mean",
            "bn.running_var",
            "bn.num_batches_tracked",
        }
    # clear arrays are aggregated in plaintext with the same weights: exactly the plaintext result
    for key in ("bn.weight", "bn.running_mean"):
        np.testing.assert_array_equal(update.params[key], g_plain[key])
    assert "fc.weight" not in update.params  # the server has no plaintext for encrypted arrays


def test_selectors_and_pattern_errors():
    g = small_model()
    assert select_encrypted_keys(g) == [k for k in g if k != "bn.num_batches_tracked"]
    assert select_encrypted_keys(g, ["largest:2"]) == ["conv.weight", "fc.weight"]
    assert select_encrypted_keys(g, ["last:2"]) == ["fc.weight", "fc.bias"]
    assert select_encrypted_keys(g, ["bn.running_*"]) == ["bn.running_mean", "bn.running_var"]
    with pytest.raises(ValueError, match="'head.*' matches no floating-point parameter"):
        select_encrypted_keys(g, ["head.*"])
    with pytest.raises(ValueError, match="matches no floating-point"):
        select_encrypted_keys(g, ["bn.num_batches_tracked"])  # integer buffers always travel in clear
    with pytest.raises(ValueError, match="list of patterns"):
        select_encrypted_keys(g, "fc.*")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------ robustness
def test_server_rejects_malformed_results(contexts):
    secret, public = contexts
    g0 = small_model()
    server = EncryptedGlobalModel(public, g0)
    good = encode_update(secret, trained(g0, 1, 1), g0, server.layout)
    short = {k: v for k, v in good.items() if k != f"{UPDATE_PREFIX}000004"}
    with pytest.raises(ValueError, match="site-x: 4 ciphertext chunk"):
        server.check_params("site-x", short)
    leaked = {**good, "fc.weight": g0["fc.weight"]}
    with pytest.raises(ValueError, match="in clear"):
        server.check_params("site-x", leaked)
    plain = dict(g0)
    with pytest.raises(ValueError, match="no encrypted update"):
        server.check_params("site-x", plain)
    swapped = {**good, f"{UPDATE_PREFIX}000000": good[f"{UPDATE_PREFIX}000004"]}
    with pytest.raises(ValueError, match="chunk 0 holds 535 values, expected 4096"):
        server.check_params("site-x", swapped)
    with pytest.raises(ValueError, match="not a CKKS vector"):
        server.check_params("site-x", {**good, f"{UPDATE_PREFIX}000001": np.arange(50, dtype=np.uint8)})


def test_a_contribution_under_another_key_is_detected_at_the_sites(contexts):
    secret, public = contexts
    g0 = small_model()
    server = EncryptedGlobalModel(public, g0)
    good = encode_update(secret, trained(g0, 1, 1), g0, server.layout)
    # a site with a kit from another provisioning: the server cannot tell (same CKKS parameters) ...
    foreign = encode_update(make_context(), trained(g0, 2, 1), g0, server.layout)
    contributions = [server.check_params("site-1", good), server.check_params("site-2", foreign)]
    reports = [ClientReport(name="site-1", num_samples=10), ClientReport(name="site-2", num_samples=10)]
    fedavg = get_scheme("fedavg")
    server.aggregate(fedavg, reports, contributions, server.weigh(fedavg, reports, contributions, 1, 2))
    assert server.meta()["check"] == pytest.approx(1.0)
    # ... but the check slot no longer decrypts to the sum of the weights
    with pytest.raises(ValueError, match="another key"):
        decode_global(secret, server.task_params(), server.meta(), g0)


def test_site_rejects_a_layout_for_another_model(contexts):
    secret, public = contexts
    g0 = small_model()
    server = EncryptedGlobalModel(public, g0)
    other = {**g0, "fc.weight": np.zeros((14, 1000), np.float32)}
    with pytest.raises(ValueError, match="does not match the server's HE layout"):
        decode_global(secret, server.task_params(), server.meta(), other)


def test_values_beyond_the_ckks_range_are_refused(contexts):
    secret, _ = contexts
    with pytest.raises(ValueError, match="CKKS limit"):
        encrypt_chunks(secret, np.array([0.0, 3e5]))
    with pytest.raises(ValueError, match="NaN"):
        encrypt_chunks(secret, np.array([0.0, np.nan]))


def test_state_survives_save_and_load(contexts, tmp_path):
    secret, public = contexts
    g0 = small_model()
    server = EncryptedGlobalModel(public, g0)
    sites = [trained(g0, k, 1) for k in range(2)]
    reports = [ClientReport(name=f"s{k}", num_samples=10) for k in range(2)]
    _, g1, _ = he_round(server, secret, g0, sites, reports, get_scheme("fedavg"), 1, 2)
    server.save(tmp_path / "he.npz")
    with np.load(tmp_path / "he.npz") as npz:  # ciphertext and the integer buffer only
        assert {f.split("/")[0] for f in npz.files} == {
            "clear",
            "enc",
            "layout_fingerprint",
            "check_value",
            "contributions",
            "round_steps",
        }
    restored = EncryptedGlobalModel(public, g0)
    restored.load(tmp_path / "he.npz")
    again, _ = decode_global(secret, restored.task_params(), restored.meta(), g0)
    assert max_abs_diff(again, g1) == 0.0
    chunks, _ = unpack_chunks(restored.task_params(), GLOBAL_PREFIX)
    assert len(chunks) == restored.layout.num_chunks


def test_a_state_resumed_under_other_keys_is_refused_at_the_sites(contexts, tmp_path):
    """docs/deploy.md: a run resumed under other keys fails when the sites decrypt the saved model."""
    secret, public = contexts
    g0 = small_model()
    server = EncryptedGlobalModel(public, g0)
    sites = [trained(g0, k, 1) for k in range(2)]
    reports = [ClientReport(name=f"s{k}", num_samples=10) for k in range(2)]
    he_round(server, secret, g0, sites, reports, get_scheme("fedavg"), 1, 2)
    server.save(tmp_path / "he.npz")
    other_secret = make_context()  # new keys (another provisioning, or a new simulator run)
    other_public = context_from_bytes(serialize_context(other_secret, with_secret_key=False), role="server")
    resumed = EncryptedGlobalModel(other_public, g0)
    resumed.load(tmp_path / "he.npz")
    with pytest.raises(ValueError, match="another key"):
        decode_global(other_secret, resumed.task_params(), resumed.meta(), g0)


# --------------------------------------------------------------------------------------- schemes
@pytest.mark.parametrize(
    ("name", "options", "reason"),
    [
        ("ida", {}, "inverse distance"),
        ("fedawa", {}, "client vectors"),
        ("fedadp", {}, "angle"),
        ("feddraw", {"similarity": "delta"}, "similarity='delta'"),
    ],
)
def test_schemes_needing_plaintext_models_are_refused(name, options, reason):
    with pytest.raises(HEIncompatibleScheme, match=reason) as info:
        get_scheme(name, **options).check_he()
    assert f"scheme {name!r}" in str(info.value)


@pytest.mark.parametrize("name", ["fedavg", "fedprox", "fednova", "cbr", "dafl", "feddisco", "feddraw"])
def test_scalar_schemes_are_accepted(name):
    get_scheme(name).check_he()


def test_the_refusal_names_the_schemes_that_run_under_he():
    """The list in the refusal is derived from the schemes themselves, not written out."""
    assert he_capable_schemes() == (
        "cbr",
        "dafl",
        "fedavg",
        "feddisco",
        "feddraw",
        "fednova",
        "fedprox",
        "uniform",
    )
    with pytest.raises(
        HEIncompatibleScheme, match=r"\(cbr, dafl, fedavg, feddisco, feddraw, fednova, fedprox, uniform\)"
    ):
        get_scheme("ida").check_he()
