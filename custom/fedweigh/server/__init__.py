"""The server's round: check, weigh, cap and aggregate the sites' results, and record what happened.

- :mod:`fedweigh.server.rounds`: :class:`~fedweigh.server.rounds.RoundStep` and its backends;
- :mod:`fedweigh.server.validation`: the checks of one client result;
- :mod:`fedweigh.server.quorum`: how many contributions a secure sum needs;
- :mod:`fedweigh.server.label_stats`: the server's side of the label-statistics phase;
- :mod:`fedweigh.server.encrypted`: the global model under homomorphic encryption (CKKS backend);
- :mod:`fedweigh.server.records`: the run's per-round rows, files and plots.
"""
