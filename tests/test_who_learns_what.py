"""docs/privacy.md, "Who can learn what": the cells that no other test shows, through the real exchange code.

The server in ``plain`` mode reads each site's contribution; in ``secure`` mode it holds ciphertext only,
but every site holds the one secret key, so a server colluding with one site reads each site's
contribution and each site's encrypted model update; sites colluding against the last one subtract their
own contributions from the sum. What they read is the exact histogram under a policy that allows exact
statistics, and the site's Gaussian release (never the exact histogram) under the default policy.
"""

from __future__ import annotations

import base64

import numpy as np
from test_stats_privacy import COUNTS, EXACT, SITES, N, exchange

from fedweigh.histograms import META_VECTOR, statistics_vector
from fedweigh.secure.exchange import META_CIPHERTEXT
from fedweigh.secure.updates import HELayout, decrypt_chunks, encrypt_chunks
from fedweigh.secure.vectors import decrypt_vector
from fedweigh.site.policy import PERMISSIVE_DEFAULT

C = len(COUNTS["site-1"])


def _exact_vector(site: str) -> np.ndarray:
    return statistics_vector(COUNTS[site], N)


def test_plain_mode_shows_the_server_each_sites_contribution_exact_or_released(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, exact = exchange("job-plain-exact", SITES, "plain", EXACT)
    for site in SITES:
        np.testing.assert_array_equal(exact.collected[site][META_VECTOR], _exact_vector(site))
    _, default = exchange("job-plain-default", SITES, "plain", PERMISSIVE_DEFAULT)
    for site in SITES:
        seen = np.asarray(default.collected[site][META_VECTOR])
        assert seen.size == C + 2 and not np.array_equal(seen[:C], COUNTS[site]), site


def test_secure_mode_shows_the_server_ciphertext_only(sim_keys):
    _, controller = exchange("job-secure", SITES, "secure", EXACT)
    for site in SITES:
        meta = controller.collected[site]
        assert META_VECTOR not in meta
        text = repr(meta)
        for count in COUNTS[site][:2]:  # no count appears in clear next to the ciphertext
            assert f" {int(count)}," not in text and f"[{int(count)}," not in text


def _decrypt_contribution(ctx, meta: dict) -> np.ndarray:
    data = base64.b64decode(meta[META_CIPHERTEXT])
    return decrypt_vector(ctx, data, C + 2 + 3, 1)[:C]  # the vector, then its 3 binding-tag slots


def test_a_server_colluding_with_one_site_reads_each_contribution_released_not_exact(sim_keys):
    """One secret key for all sites: the colluding site's context decrypts another site's ciphertext; under
    the default policy what it reads is that site's Gaussian release, under an exact policy its histogram."""
    _, exact = exchange("job-collude-exact", SITES, "secure", EXACT)
    np.testing.assert_array_equal(
        _decrypt_contribution(sim_keys, exact.collected["site-4"]), COUNTS["site-4"]
    )
    _, default = exchange("job-collude-default", SITES, "secure", PERMISSIVE_DEFAULT)
    read = _decrypt_contribution(sim_keys, default.collected["site-4"])
    assert not np.array_equal(read, COUNTS["site-4"])
    assert np.abs(read - COUNTS["site-4"]).max() < 200  # the release: noise of sigma ~ 11 counts, no more


def test_all_other_sites_colluding_read_the_last_sites_release_not_its_histogram(sim_keys):
    """Sites 1-3 subtract their own releases from the sum they decode: site-4's histogram under an exact
    policy, its noised release under the default one."""

    def last_site(policy, job: str) -> np.ndarray:
        sites, _ = exchange(job, SITES, "secure", policy)
        own = sum(np.asarray(sites[s].released_statistics().class_counts) for s in SITES[:3])
        return sites["site-1"].global_stats.class_counts - own

    np.testing.assert_array_equal(last_site(EXACT, "job-k-1-exact"), COUNTS["site-4"])
    assert not np.array_equal(last_site(PERMISSIVE_DEFAULT, "job-k-1-default"), COUNTS["site-4"])


def test_under_he_a_site_holding_the_key_decrypts_another_sites_update(sim_keys):
    """Under HE the server holds ciphertext only, but a site's key decrypts any site's update: a server
    colluding with one site reads every update (docs/privacy.md, Limits)."""
    update = {"w": np.linspace(-0.05, 0.05, 300).reshape(10, 30)}
    layout = HELayout.build(update, list(update))
    sent = np.append(layout.flatten(update), 1.0)  # the update, then its check slot
    chunks = encrypt_chunks(sim_keys, sent)
    np.testing.assert_allclose(decrypt_chunks(sim_keys, chunks, layout), sent, atol=1e-4)
