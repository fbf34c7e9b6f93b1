"""FedweighController refuses bad options at job creation, naming the option."""

import pytest

from fedweigh.flare.controller import FedweighController


@pytest.mark.parametrize(
    "options, message",
    [
        ({"num_rounds": 0}, "num_rounds"),
        ({"sample_fraction": 0.0}, "sample_fraction"),
        ({"statistics": "open"}, "statistics"),
        ({"max_share": 1.5}, "max_share"),
        ({"max_share": "half"}, "max_share"),
        ({"update_norm_bound": 0.5}, "update_norm_bound"),
        ({"min_secure_sum": 1}, "min_secure_sum"),
        ({"min_update_cosine": 2.0}, "min_update_cosine"),
        ({"train_timeout": -1}, "train_timeout"),
        ({"stop_after": 9, "num_rounds": 3}, "stop_after"),
        ({"memory_gc_rounds": -1}, "memory_gc_rounds"),
        ({"memory_gc_rounds": 1.5}, "memory_gc_rounds"),
        ({"scheme": "feddisco", "scheme_args": {"target": "global"}}, "global label histogram"),
    ],
)
def test_bad_options_are_named(options, message):
    with pytest.raises(ValueError, match=message):
        FedweighController(**options)


def test_defaults_free_memory_every_round_and_never_wait_forever():
    controller = FedweighController()
    assert controller.memory_gc_rounds == 1
    assert controller.train_timeout == 3600  # a silent site cannot stall the job
    assert controller.max_share == "auto" and controller.update_norm_bound == 1.0  # bounded influence
    assert controller.min_secure_sum == 3 and controller.min_update_cosine == 0.0
