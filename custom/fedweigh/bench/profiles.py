"""Benchmark profiles: how big a run is (data, model, rounds, local steps, scenarios, methods, seeds).

=======  ====================================================================================
smoke    2 scenarios x 4 methods (FedDRAW, FedBB, FedAvg, centralized) x 1 seed, 240 images at
         28 px, compact DenseNet, 2 rounds of at most 2 local steps (batch 16). Used by the tests;
         well under 2 minutes on 2 cores.
quick    all 15 scenarios x 10 federated methods + 2 references x 1 seed, 2,400 images at 32 px
         (digits: its 1,437-image pool), compact DenseNet, 4 rounds of at most 8 local steps
         (batch 32); thresholds by Youden's J on validation (after 4 short rounds few
         sigmoid outputs pass 0.5, and GM at 0.5 is 0 for every method). Sized for <= 45 minutes
         on 2 CPU cores with ``--jobs 2``.
standard trains to a plateau on 2 CPU cores: 4 scenarios (quantity-shift, label-a0.5, noisy-large,
         rare-small) x 8 methods (FedAvg, FedDRAW, FedAdp, FedBB and its PNB / CBR ablations, DAFL
         and its loss ablation) x 3 seeds, 2,400 images at 32 px with 10,000 SynthCXR test images,
         30 rounds of a full local epoch with the client optimizer kept, scored every 5 rounds.
         Sized for <= 90 minutes on 2 CPU cores.
paper    the papers' scale for a GPU machine: all scenarios and methods, 3 seeds, 50 rounds of one
         local epoch (batch 32); DenseNet121 at 224 px on ChestMNIST / CheXpert, at 64 px on
         SynthCXR (20,000 images); compact DenseNet at 32 px on digits; threshold 0.5.
=======  ====================================================================================

Every federated method and reference in a profile trains with the same :class:`ClientArgs`
(model, optimiser, epochs, batch, learning rate, step cap, seed); only the loss differs, and only
where a method prescribes one, unless a method's label or catalogue entry sets client options
(:data:`fedweigh.methods.CLIENT_OPTIONS`, e.g. ``fedbb-paper``'s SGD).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

from fedweigh.data.scenarios import SCENARIOS
from fedweigh.methods import ALL_METHODS
from fedweigh.site.args import ClientArgs

#: The standard profile's methods: each claim of the three papers with the ablation that carries it.
STANDARD_METHODS = ("fedavg", "feddraw", "fedadp", "fedbb", "fedbb-pnb", "fedbb-cbr", "dafl", "dafl-loss")


def _all_scenarios() -> tuple[str, ...]:
    return tuple(SCENARIOS)


@dataclass(frozen=True)
class Profile:
    """A named benchmark size.

    client: :class:`ClientArgs` fields shared by every dataset (size, num_images, arch, epochs,
        batch_size, lr, max_steps, ...); ``per_dataset`` overrides them for one dataset.
    scenarios / methods: the defaults when the caller names none (empty = all).
    threshold: how multi-label test predictions become 0/1 for GM, precision, recall, F1 and
        specificity: ``"0.5"`` on the sigmoid, or ``"youden"`` (per finding, Youden's J on the union
        of the sites' validation splits, for the model being scored).
    eval_every: score the global model every k rounds and after the last (1: every round).
    """

    name: str
    description: str
    rounds: int
    seeds: tuple[int, ...]
    scenarios: tuple[str, ...]
    methods: tuple[str, ...]
    client: dict = field(default_factory=dict)
    per_dataset: dict[str, dict] = field(default_factory=dict)
    threshold: str = "0.5"
    eval_every: int = 1

    def default_scenarios(self) -> tuple[str, ...]:
        return self.scenarios or _all_scenarios()

    def default_methods(self) -> tuple[str, ...]:
        return self.methods or ALL_METHODS

    def client_args(self, dataset: str, **overrides: object) -> ClientArgs:
        """The profile's :class:`ClientArgs` for ``dataset`` (scenario and seed are set per cell).

        ``overrides`` (any ClientArgs field, e.g. ``data_path``, ``max_steps``) win over the profile;
        a value of None in ``overrides`` keeps the profile's value.
        """
        known = {f.name for f in fields(ClientArgs)}
        settings = {**self.client, **self.per_dataset.get(dataset, {})}
        settings.update({k: v for k, v in overrides.items() if v is not None})
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ValueError(f"profile {self.name!r}: unknown ClientArgs field(s) {unknown}")
        return replace(ClientArgs(dataset=dataset), **settings)


PROFILES: dict[str, Profile] = {
    "smoke": Profile(
        name="smoke",
        description="seconds-scale check of the whole pipeline (used by the tests)",
        rounds=2,
        seeds=(0,),
        scenarios=("iid-4", "label-a0.5"),
        methods=("feddraw", "fedbb", "fedavg", "centralized"),
        client={
            "size": 28,
            "num_images": 240,
            "arch": "densenet_compact",
            "epochs": 1,
            "batch_size": 16,
            "lr": 1e-3,
            "max_steps": 2,
        },
    ),
    "quick": Profile(
        name="quick",
        description="all scenarios and methods, one seed, compact model (<= 45 min on 2 CPU cores)",
        rounds=4,
        seeds=(0,),
        scenarios=(),
        methods=(),
        client={
            "size": 32,
            "num_images": 2400,
            "arch": "densenet_compact",
            "epochs": 1,
            "batch_size": 32,
            "lr": 1e-3,
            "max_steps": 8,
        },
        per_dataset={"digits": {"num_images": None}},
        threshold="youden",
    ),
    "standard": Profile(
        name="standard",
        description=(
            "trains to a plateau on 2 CPU cores: 30 rounds of a full local epoch, client optimizer "
            "state kept across rounds, 3 seeds, scored every 5 rounds"
        ),
        rounds=30,
        seeds=(0, 1, 2),
        # the grid that fits 90 minutes on 2 CPU cores (96 cells of about 47 s): the scenarios whose
        # heterogeneity the papers' claims are about, FedAvg, FedDRAW and its closest baseline
        # (FedAdp: cosine-similarity weights), FedBB and DAFL with the ablations that split loss from
        # weighting. Left out by default (name them to run them): fedprox, fednova, ida, feddisco,
        # fedawa, centralized, local; degraded-large, test-mix and the other scenarios.
        scenarios=("quantity-shift", "label-a0.5", "noisy-large", "rare-small"),
        methods=STANDARD_METHODS,
        client={
            "size": 32,
            "num_images": 2400,
            "arch": "densenet_compact",
            "epochs": 1,
            "batch_size": 32,
            "lr": 1e-3,
            "max_steps": None,
            "keep_optimizer": True,
        },
        # SynthCXR generates its test images: 10,000 (not 480) put dozens of positives of even the
        # rarest finding in the test set, for about 15 s per scoring of the compact DenseNet on 1 core
        per_dataset={"digits": {"num_images": None}, "synthcxr": {"test_images": 10_000}},
        threshold="youden",
        eval_every=5,
    ),
    "paper": Profile(
        name="paper",
        description="paper-size settings for a GPU machine (3 seeds, 50 rounds, DenseNet121)",
        rounds=50,
        seeds=(0, 1, 2),
        scenarios=(),
        methods=(),
        client={
            "size": 224,
            "num_images": None,
            "arch": "densenet121",
            "epochs": 1,
            "batch_size": 32,
            "lr": 1e-3,
            "max_steps": None,
            "keep_optimizer": True,
            "device": "auto",
        },
        eval_every=5,
        per_dataset={
            "synthcxr": {"size": 64, "num_images": 20000},
            "digits": {"size": 32, "arch": "densenet_compact"},
        },
    ),
}


#: The ways of turning multi-label scores into 0/1 predictions.
THRESHOLDS: tuple[str, ...] = ("0.5", "youden")


def get_profile(name: str) -> Profile:
    """The profile called ``name``; ValueError listing the known profiles otherwise."""
    try:
        return PROFILES[name]
    except KeyError:
        raise ValueError(f"unknown profile {name!r}; known: {', '.join(PROFILES)}") from None
