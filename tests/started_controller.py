"""The fedweigh controller of the failure tests: every site has started before the timed rounds begin.

``train_timeout`` counts from the moment a task is sent; in round 1 it would also have to cover each
site's start-up (its process, imports, data and model; about 25 s for four sites on two quiet cores), so
a healthy site on a loaded machine could miss it. This subclass first sends one untimed ``validate``
task to every site and waits for all the answers; the rounds that follow are :class:`FedweighController`'s
own, timed as configured.
"""

from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from fedweigh.arrays import to_numpy_dict
from fedweigh.flare.controller import FedweighController
from fedweigh.protocol import TASK_VALIDATE


class StartedFedweighController(FedweighController):
    def run(self) -> None:
        sites = sorted(c.name for c in self.engine.get_clients())
        initial = FLModel(params_type=ParamsType.FULL, params=to_numpy_dict(self.load_model().params))
        answers = self.broadcast_model(task_name=TASK_VALIDATE, data=initial, targets=sites, timeout=0)
        self.info(f"every site has started ({len(answers)} answers); the timed rounds begin")
        super().run()
