"""Edges of the CKKS statistics vectors: each refusal says exactly what is wrong, and the size limit
binds at 2^50 itself."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_secure import client_ctx, key_dir, server_ctx  # noqa: F401  (module fixtures)

from fedweigh.secure.contexts import make_context
from fedweigh.secure.vectors import (
    MAX_ABS_VALUE,
    ciphertext_size,
    decrypt_vector,
    encrypt_vector,
    sum_encrypted,
)


def _exactly(message: str) -> str:
    return f"^{re.escape(message)}$"


def test_encrypt_refusals_say_what_is_wrong(client_ctx, server_ctx):  # noqa: F811
    with pytest.raises(ValueError, match=_exactly("cannot encrypt a vector with NaN or infinite entries")):
        encrypt_vector(client_ctx, [1.0, float("inf")])
    with pytest.raises(ValueError, match=_exactly("encrypting needs the client context (with secret key)")):
        encrypt_vector(server_ctx, [1.0])
    with pytest.raises(ValueError, match=_exactly("no ciphertexts to sum")):
        sum_encrypted(server_ctx, [])


def test_the_size_limit_binds_at_two_to_the_fifty(client_ctx):  # noqa: F811
    with pytest.raises(ValueError, match=r"^entry 1\.13e\+15 is too large for an exact CKKS sum"):
        encrypt_vector(client_ctx, [1.0, -MAX_ABS_VALUE])
    below = float(np.nextafter(MAX_ABS_VALUE, 0.0))
    assert len(encrypt_vector(client_ctx, [1.0, -below])) > 0


def test_decrypt_refusals_say_what_is_wrong(client_ctx, server_ctx):  # noqa: F811
    data = encrypt_vector(client_ctx, [2.0])
    with pytest.raises(ValueError, match=_exactly("decrypting needs the client context (with secret key)")):
        decrypt_vector(server_ctx, data, 1, num_contributions=1)
    with pytest.raises(ValueError, match=r"^not a CKKS ciphertext for this context \(.+\)$"):
        decrypt_vector(client_ctx, b"not a ciphertext", 1, num_contributions=1)


def test_a_forged_or_foreign_count_says_which_and_why(client_ctx, server_ctx):  # noqa: F811
    total = sum_encrypted(server_ctx, [encrypt_vector(client_ctx, [1.0, 2.0])] * 2)
    forged = (
        r"^forged count slot: the encrypted sum's count slot decrypts to 2, the server summed 3 contribution\(s\), "
        r"and the other slots decrypt within range \(the keys match\): a site sent a contribution whose count "
        r"slot is not 1 \(or the server announced a wrong count\)$"
    )
    with pytest.raises(ValueError, match=forged):
        decrypt_vector(client_ctx, total, 2, num_contributions=3)
    stranger = make_context()
    mixed = sum_encrypted(server_ctx, [encrypt_vector(client_ctx, [5.0]), encrypt_vector(stranger, [7.0])])
    foreign = (
        r"^the encrypted sum does not decrypt consistently \(count slot .+, expected 2\): the contributions were "
        r"encrypted with different keys \(startup kits from different provisionings, or simulation keys mixed "
        r"with kit keys\) or were corrupted$"
    )
    with pytest.raises(ValueError, match=foreign):
        decrypt_vector(client_ctx, mixed, 1, num_contributions=2)


def test_a_ciphertext_that_is_not_a_fresh_encryption_is_refused_saying_how():
    import tenseal as ts

    from fedweigh.secure.vectors import check_fresh_ciphertext

    ctx = make_context()
    fresh = ts.ckks_vector(ctx, [1.0, 2.0])
    check_fresh_ciphertext(ctx, fresh, "site-9")  # a site's encryption passes
    cases = [
        (
            ts.ckks_vector(ctx, [1.0], scale=2**30),
            "site-9: a ciphertext is at CKKS scale 2^30.00, the context's scale is 2^40.00",
        ),
        (
            fresh * 2.0,
            "site-9: a ciphertext is at another CKKS level (1 primes left) than a fresh encryption under this context",
        ),
    ]
    ctx.auto_relin = False  # a product left unrelinearised: three polynomials
    cases.append((fresh * fresh, "site-9: a ciphertext has 3 polynomials, a fresh encryption has 2"))
    for vec, message in cases:
        with pytest.raises(ValueError, match=_exactly(message)):
            check_fresh_ciphertext(ctx, vec, "site-9")


def test_a_transparent_ciphertext_is_refused():
    """SEAL refuses to produce one in an evaluation, so a stand-in with a fresh one's other properties."""
    import tenseal as ts

    from fedweigh.secure.vectors import check_fresh_ciphertext

    ctx = make_context()
    real = ts.ckks_vector(ctx, [1.0]).ciphertext()[0]

    class Transparent:
        scale = real.scale

        def size(self):
            return 2

        def parms_id(self):
            return real.parms_id()

        def is_transparent(self):
            return True

    class Vector:
        def ciphertext(self):
            return [Transparent()]

    with pytest.raises(
        ValueError, match=_exactly("site-9: a ciphertext is transparent (it encrypts nothing)")
    ):
        check_fresh_ciphertext(ctx, Vector(), "site-9")


def test_ciphertext_size_counts_the_slots_of_a_serialised_vector(client_ctx, server_ctx):  # noqa: F811
    """2L + 1 slots for a vector of length L (low limbs, high limbs, the contribution count)."""
    data = encrypt_vector(client_ctx, [1.0, 2.0, 3.0])
    assert ciphertext_size(server_ctx, data) == 7
    assert ciphertext_size(client_ctx, encrypt_vector(client_ctx, [5.0])) == 3
    with pytest.raises(ValueError, match=r"^not a CKKS ciphertext for this context \(.+\)$"):
        ciphertext_size(server_ctx, b"not a ciphertext")
