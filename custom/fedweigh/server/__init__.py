"""The server's round: check, weigh, cap and aggregate the sites' results, and record what happened.

- :mod:`fedweigh.server.loop`: :func:`~fedweigh.server.loop.run_rounds`, the rounds of a run (the NVFlare
  controller and the benchmark drive it, each with its transport);
- :mod:`fedweigh.server.rounds`: :class:`~fedweigh.server.rounds.RoundStep`, one round, and its backends;
- :mod:`fedweigh.server.safeguards`: :class:`~fedweigh.server.safeguards.Safeguards`, the round step's
  settings, and the weight cap, norm bound, direction check and replay store they drive;
- :mod:`fedweigh.server.validation`: the checks of one client result (and of its metrics' names);
- :mod:`fedweigh.server.model_check`: the aggregate's check before it becomes the global model, and
  the median buffers;
- :mod:`fedweigh.server.quorum`: how many contributions a secure sum needs;
- :mod:`fedweigh.server.label_stats`: the server's side of the label-statistics phase;
- :mod:`fedweigh.server.encrypted`: the global model under homomorphic encryption (CKKS backend);
- :mod:`fedweigh.server.records`: the run's per-round rows, files and plots.
"""
