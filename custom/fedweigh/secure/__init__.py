"""Security for a fedweigh federation: homomorphic encryption (TenSEAL CKKS) and differential privacy.

One concern per module (importing this package imports none of them, and no TenSEAL, Opacus or torch):

Homomorphic encryption
    - :mod:`~fedweigh.secure.contexts`: CKKS contexts and key files (NVFlare HEBuilder's), where a
      process finds them (env, startup kit, simulator-only keys), simulation-key markers.
    - :mod:`~fedweigh.secure.vectors`: the exact split-limb slot encoding, Enc(v), sum_k Enc(v_k) and
      decryption of a statistics vector.
    - :mod:`~fedweigh.secure.exchange`: :class:`~fedweigh.secure.exchange.SecureExchange`, the
      ``secure`` label-statistics exchange; it takes a context provider (no NVFlare import; the
      NVFlare one, with signature checks, is :func:`fedweigh.flare.keys.role_context_provider`).
    - :mod:`~fedweigh.secure.updates`: encrypted model updates (HE aggregation of the model).
    - :mod:`~fedweigh.server.quorum`: how many contributions any secure sum needs before anyone may
      decrypt it (the server's minimum and each site's policy).

Differential privacy
    - :mod:`~fedweigh.secure.dp_config`: ``DPConfig`` (DP-SGD), ``StatsDPConfig`` (label statistics),
      ``PrivacyBudgetExhausted``.
    - :mod:`~fedweigh.secure.gaussian`: the Gaussian mechanism on a label histogram (sensitivity,
      analytic and classic sigma, ``privatize_histogram``); math only.
    - :mod:`~fedweigh.secure.stats_release`: ``HistogramReleaser``, a site's once-per-job release of
      its label histogram, kept in memory and on disk.
    - :mod:`~fedweigh.secure.grad_sample`: per-sample losses and gradients (fedweigh's fast layer
      hooks), the clipping optimizer, ``clipped_mean_gradient``.
    - :mod:`~fedweigh.secure.accountant`: Opacus accountants, epsilon of a step history, and the
      per-job file that keeps a site's DP-SGD account.
    - :mod:`~fedweigh.secure.dp_sgd`: ``DPSGD`` (a site's DP-SGD across rounds) and ``DPRoundReport``.

docs/privacy.md describes the threat model and both mechanisms.
"""
