"""The wire protocol between the fedweigh server and its sites: task names, meta keys, file names.

Plain constants (no NVFlare import): the NVFlare controller and client script, the round step and the
benchmark all read them here.
"""

from __future__ import annotations

#: Task names. One Client API script dispatches on ``flare.get_task_name()``.
TASK_TRAIN = "train"
TASK_VALIDATE = "validate"
TASK_STATS = "stats"

#: Meta key the server puts on a task to tell the client what its scheme needs this round.
META_PLAN = "fedweigh_plan"
#: Meta key of a client result holding the scalars its scheme asked for.
META_SCALARS = "fedweigh_scalars"
#: Meta key of a client result holding its local training-set size N_k.
META_NUM_SAMPLES = "num_samples"
#: Meta key of a client result holding its local optimisation steps tau_k (NVFlare's FLMetaKey).
META_NUM_STEPS = "NUM_STEPS_CURRENT_ROUND"
#: Meta key of a task that carries the HE layout (fedweigh.secure.updates); its presence means HE mode.
META_HE = "fedweigh_he"
#: Meta key of a site's answer when its site policy (fedweigh.site.policy) refuses a task: the reason.
META_REFUSED = "fedweigh_refused"
#: Meta key set (True) with META_REFUSED when the site refuses the whole job, not just this task.
META_REFUSED_JOB = "fedweigh_refused_job"
#: Meta key of a contribution to a secure sum: the fewest contributions the site's policy accepts.
META_MIN_SECURE_SUM = "fedweigh_min_secure_sum"
#: Meta key of a site's result under HE: why it refused the global model it decrypted (it trained on its
#: last good model instead; :mod:`fedweigh.site.he_guard`).
META_HE_REFUSED = "fedweigh_he_refused"
#: Meta key of a site's answer when its script failed on the task: the error, for the server's log.
META_SITE_ERROR = "fedweigh_site_error"

#: The fewest contributions any secure sum may hold (a sum of one is that site's own value).
ABSOLUTE_MIN = 2
#: A weight below this in magnitude contributes nothing to an encrypted sum (a zero plaintext makes
#: SEAL's product "transparent", which it refuses); the skipped term is below 1e-12 * |Delta|.
ZERO_WEIGHT = 1e-12

#: Files the controller writes into the server's run directory.
METRICS_JSON = "fedweigh_metrics.json"
METRICS_CSV = "fedweigh_metrics.csv"
STATE_JSON = "fedweigh_state.json"
WEIGHTS_PLOT = "fedweigh_client_weights.png"
AUC_PLOT = "fedweigh_auc_by_round.png"

#: Environment variable / workspace file that holds a site's local data settings in a deployment.
SITE_CONFIG_ENV = "FEDWEIGH_SITE_CONFIG"
SITE_CONFIG_FILE = "fedweigh_site.json"

#: Environment variable / file in the site's ``local/`` folder that holds the site's privacy policy.
SITE_POLICY_ENV = "FEDWEIGH_SITE_POLICY"
SITE_POLICY_FILE = "fedweigh_policy.json"
