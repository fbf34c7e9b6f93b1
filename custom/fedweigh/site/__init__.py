"""The hospital's side: the site's arguments, its trainer, its scheme scalars, its privacy policy and its data config.

- :mod:`fedweigh.site.args`: :class:`~fedweigh.site.args.ClientArgs`, the client script's arguments,
  each option declared once (the command line, the training and privacy settings, the method
  options and the bench's flags derive from it);
- :mod:`fedweigh.site.trainer`: :class:`~fedweigh.site.trainer.SiteTrainer`, one site's local work
  (the NVFlare client and the benchmark drive the same class);
- :mod:`fedweigh.site.scalars`: plan -> the scheme's client scalars, the one function every client
  calls (fedweigh's, a script of your own, the MONAI Bundle client);
- :mod:`fedweigh.site.policy`: what the hospital accepts of a job, and its epsilon ledger;
- :mod:`fedweigh.site.data_config`: where a deployed site's data lives (``fedweigh_site.json``).
"""
