"""The hospital's side: the site's arguments, its trainer, its privacy policy and its data config.

- :mod:`fedweigh.site.args`: :class:`~fedweigh.site.args.ClientArgs`, the client script's arguments;
- :mod:`fedweigh.site.trainer`: :class:`~fedweigh.site.trainer.SiteTrainer`, one site's local work
  (the NVFlare client and the benchmark drive the same class);
- :mod:`fedweigh.site.policy`: what the hospital accepts of a job, and its epsilon ledger;
- :mod:`fedweigh.site.data_config`: where a deployed site's data lives (``fedweigh_site.json``).
"""
