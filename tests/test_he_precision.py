"""The precision the sites keep decrypted values at (fedweigh.secure.precision): every decrypted CKKS
value, of the global model and of the statistics sum, is the rounding of the raw decryption to 2^-b,
never the raw decryption (whose noise reveals the secret key); b is a job argument with bounds on both
sides, checked where the job is built and where a site reads it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tenseal as ts

from fedweigh.errors import ConfigError
from fedweigh.secure.contexts import context_from_bytes, make_context, serialize_context
from fedweigh.secure.precision import (
    DEFAULT_PRECISION_BITS,
    MAX_PRECISION_BITS,
    MIN_PRECISION_BITS,
    check_precision_bits,
    precision_bits_for,
    round_decrypted,
)
from fedweigh.secure.updates import GLOBAL_PREFIX, HELayout, decrypt_global, unpack_chunks
from fedweigh.secure.vectors import LIMB_BASE, decrypt_vector, encrypt_vector, sum_encrypted
from fedweigh.server.encrypted import EncryptedContribution, EncryptedGlobalModel
from fedweigh.weighting import ClientReport, get_scheme


@pytest.fixture(scope="module")
def contexts():
    secret = make_context()
    public = context_from_bytes(serialize_context(secret, with_secret_key=False), role="server")
    return secret, public


def _model(seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.normal(0, 0.2, (40, 120)).astype(np.float32),  # 4800 values: two ciphertexts
        "b": rng.normal(0, 0.2, 40).astype(np.float32),
        "steps": np.array(3, dtype=np.int64),  # travels in clear
    }


def _encrypted_global(contexts):
    """(what the server sends after one aggregation of three sites' encrypted updates, its meta,
    the site's reference model)."""
    from fedweigh.secure.updates import encode_update

    secret, public = contexts
    g0 = _model(0)
    server = EncryptedGlobalModel(public, g0)
    layout = HELayout.from_meta(server.meta(), g0)
    contributions = []
    for k in range(3):
        trained = {key: (v + 0.01 * (k + 1)).astype(v.dtype) for key, v in g0.items()}
        sent = encode_update(secret, trained, g0, layout)
        contributions.append(server.check_params(f"site-{k + 1}", sent))
    assert all(isinstance(c, EncryptedContribution) for c in contributions)
    reports = [ClientReport(c.site, num_samples=10) for c in contributions]
    server.aggregate(get_scheme("fedavg"), reports, contributions, np.array([0.2, 0.3, 0.5]))
    return server.task_params(), server.meta(), g0


def _raw_decryption(secret, received) -> np.ndarray:
    """The full-precision CKKS decryption the sites no longer keep (TenSEAL directly)."""
    chunks, _ = unpack_chunks(received, GLOBAL_PREFIX)
    return np.concatenate([np.asarray(ts.ckks_vector_from(secret, c).decrypt(), np.float64) for c in chunks])


@pytest.mark.parametrize("bits", [None, 12, MAX_PRECISION_BITS])
def test_the_decrypted_global_model_is_the_rounding_of_the_raw_decryption(contexts, bits):
    secret, _ = contexts
    received, meta, g0 = _encrypted_global(contexts)
    decrypted = decrypt_global(secret, received, meta, g0, min_contributions=3, precision_bits=bits)
    assert decrypted.check_problem is None
    b = DEFAULT_PRECISION_BITS if bits is None else bits
    raw = _raw_decryption(secret, received)
    rounded = round_decrypted(raw, b)
    got = np.concatenate([decrypted.params["w"].ravel(), decrypted.params["b"].ravel()]).astype(np.float64)
    # the site's model (float32, as its reference) holds exactly the rounded values: |x| < 2^(24 - b)
    np.testing.assert_array_equal(got, rounded[:-1].astype(np.float32).astype(np.float64))
    assert np.all(np.rint(got * 2.0**b) == got * 2.0**b)  # on the 2^-b grid
    # and not the raw decryption: CKKS noise puts (nearly) every raw value off that grid
    off_grid = np.mean(raw[:-1] != rounded[:-1])
    assert off_grid > 0.99, off_grid
    assert np.abs(got - raw[:-1]).max() <= 2.0 ** -(b + 1) + 1e-7  # + float32 storage
    assert decrypted.params["steps"] == g0["steps"]


def test_the_statistics_sum_is_the_rounding_of_the_raw_decryption(contexts):
    secret, public = contexts
    rng = np.random.default_rng(3)
    vectors = [np.concatenate([rng.integers(0, 50, 5), [100.0], [rng.uniform(0, 100)]]) for _ in range(3)]
    total = sum_encrypted(public, [encrypt_vector(secret, v) for v in vectors])
    length = vectors[0].size
    raw = np.asarray(ts.ckks_vector_from(secret, total).decrypt(), np.float64)
    for bits in (DEFAULT_PRECISION_BITS, 10):
        out = decrypt_vector(secret, total, length, num_contributions=3, precision_bits=bits)
        expected = np.rint(raw[length : 2 * length]) * LIMB_BASE + round_decrypted(raw[:length], bits)
        np.testing.assert_array_equal(out, expected)
        assert np.all(out[:length] != raw[:length])  # no raw decryption noise in what the site keeps
    assert decrypt_vector(secret, total, length, 3, 10)[-1] != decrypt_vector(secret, total, length, 3)[-1]


@pytest.mark.parametrize("bits", [MIN_PRECISION_BITS - 1, MAX_PRECISION_BITS + 1, 16.0, True, "16"])
def test_precision_out_of_bounds_is_refused_everywhere(contexts, bits):
    from fedweigh.flare.recipes import FedDRAWRecipe
    from fedweigh.site.args import ClientArgs, parse_args

    secret, _ = contexts
    with pytest.raises(ValueError, match="he_precision_bits"):
        check_precision_bits(bits)
    with pytest.raises(ConfigError, match="he_precision_bits"):  # where the job is built
        FedDRAWRecipe(name="j", min_clients=2, he=True, he_precision_bits=bits)
    if isinstance(bits, int) and not isinstance(bits, bool):
        with pytest.raises(ConfigError, match="he_precision_bits"):  # where a site reads the job
            parse_args(["--he-precision-bits", str(bits)])
        with pytest.raises(ConfigError, match="he_precision_bits"):
            FedDRAWRecipe(name="j", min_clients=2, client=ClientArgs(he_precision_bits=bits))
        received, meta, g0 = _encrypted_global(contexts)
        with pytest.raises(ValueError, match="outside"):  # and at the decryption itself
            decrypt_global(secret, received, meta, g0, 3, precision_bits=bits)
        with pytest.raises(ValueError, match="outside"):
            decrypt_vector(secret, encrypt_vector(secret, [1.5]), 1, 1, precision_bits=bits)


def test_bounds_follow_the_context_scale(contexts):
    secret, _ = contexts
    assert precision_bits_for(secret) == DEFAULT_PRECISION_BITS == 16  # scale 2^40 - 24 bits
    assert precision_bits_for(secret, MIN_PRECISION_BITS) == 8
    assert precision_bits_for(secret, MAX_PRECISION_BITS) == 20
    coarse = make_context(coeff_mod_bit_sizes=(60, 30, 30), scale_bits=30)  # scale 2^30: at most 10 bits
    assert precision_bits_for(coarse, 10) == 10
    with pytest.raises(ValueError, match=r"outside \[8, 10\]"):
        precision_bits_for(coarse, 11)
    with pytest.raises(ValueError, match=r"outside \[8, 10\]"):
        precision_bits_for(coarse)  # its default, 6 bits, would wipe out updates: refused


def test_the_recipe_argument_reaches_every_sites_client_script(tmp_path):
    """he_precision_bits travels as the client script's option of the same name, in the job's client
    configuration every site runs (exported job), and the site's parser reads it back."""
    import shlex

    from fedweigh.flare.jobs import export_recipe
    from fedweigh.flare.recipes import FedDRAWRecipe
    from fedweigh.site.args import ClientArgs, parse_args

    recipe = FedDRAWRecipe(name="p", min_clients=2, he=True, he_precision_bits=12)
    job = export_recipe(recipe, tmp_path, site_installed=True)
    config = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    (argv,) = [e["executor"]["args"]["task_script_args"] for e in config["executors"]]
    assert "--he-precision-bits 12" in argv
    assert parse_args(shlex.split(argv)).he_precision_bits == 12
    # the default leaves the option out (every site then rounds to the default for its context)
    default = FedDRAWRecipe(name="d", min_clients=2, he=True)
    assert default.client_args.he_precision_bits is None
    assert "--he-precision-bits" not in default.client_args.to_argv()
    # the same value in client= is accepted; a different one is a contradiction
    same = FedDRAWRecipe(
        name="s", min_clients=2, he_precision_bits=12, client=ClientArgs(he_precision_bits=12)
    )
    assert same.client_args.he_precision_bits == 12
    with pytest.raises(ConfigError, match="give one value"):
        FedDRAWRecipe(name="c", min_clients=2, he_precision_bits=12, client=ClientArgs(he_precision_bits=14))
