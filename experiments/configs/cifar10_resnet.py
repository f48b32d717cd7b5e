"""CPT's CIFAR-10 recipe (Fu et al. 2021) with a CIFAR ResNet, scaled by `num_steps`.

Full recipe: 64k steps, batch 128, SGD momentum 0.9, lr 0.1 /10 at 50% and 75%,
weight decay 1e-4 (the default of both CPT ``train.py``), 32 cycles of 3-8 forward
bits, 8 backward bits; every conv quantized, the classifier kept in fp32.

    python -m experiments.train --workdir=/tmp/cifar --config=experiments/configs/cifar10_resnet.py \
        --config.data_dir=../shared/datasets/cifar10 --config.num_steps=2000

`--config.model=resnet38` / `resnet74` / `resnet110` for CPT's deeper models.
The run always has 32 cycles (``precision.num_cycles``), whatever ``num_steps``: a
shorter run gets shorter cycles (``P = num_steps / 32``), as CPT's code does; the
paper's 2000-step period is the 64k-step run's.

Evaluation protocol (``summary.json``'s ``eval_protocol``): by default cpt_jax's,
``max-bits/batch-ranges`` (test accuracy at ``max_bits``, each batch's own activation
ranges). ``--config=experiments/configs/cifar10_resnet.py:cpt`` selects CPT's code
(``recipe="cpt"``): evaluation every 390 steps at the current training bits with
running activation ranges (``current-bits/running-ranges``), period ``floor(T/n)``;
report ``best_test_accuracy`` (CPT prints the best) beside ``final_test_accuracy``.
It also takes CPT's classifier init ``N(0, sqrt(2 / (in * out)))``
(``model_kwargs.classifier_init="cpt"``) and its normalisation constants, mean
``(0.4914, 0.4822, 0.4465)`` and std ``(0.2023, 0.1994, 0.2010)``
(``normalize_mean`` / ``normalize_std``); cpt_jax's default normalises with the
training set's own per-channel statistics and keeps PyTorch's ``nn.Linear`` init.
"""
import ml_collections

from experiments.configs import default

RECIPES = ("", "cpt")
CPT_CIFAR_MEAN = (0.4914, 0.4822, 0.4465)  # CPT's transforms.Normalize constants
CPT_CIFAR_STD = (0.2023, 0.1994, 0.2010)


def apply_recipe(config: ml_collections.ConfigDict, recipe: str) -> ml_collections.ConfigDict:
    """`config` with the protocol of `recipe` (``""``: cpt_jax's; ``"cpt"``: CPT's code)."""
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {RECIPES}")
    config.recipe = recipe   # "" (cpt_jax's protocol) or "cpt" (CPT's code): --config=cifar10_resnet.py:cpt
    if recipe == "cpt":
        config.eval_every = 390            # CPT's train.py --eval_every
        config.precision.update(eval_bits_mode="current", activation_range="running",
                                convention="floor")
        config.normalize_mean = CPT_CIFAR_MEAN
        config.normalize_std = CPT_CIFAR_STD
        config.model_kwargs.classifier_init = "cpt"   # N(0, sqrt(2 / (in * out)))
    return config


def get_config(recipe: str = "") -> ml_collections.ConfigDict:
    config = default.get_config()
    config.update(dataset="cifar10", model="resnet20", num_steps=64_000, batch_size=128,
                  eval_batch_size=1000, augment=True, log_every=100, eval_every=2000,
                  checkpoint_every=1000)
    config.precision.num_cycles = 32
    config.optimizer.update(learning_rate=0.1, weight_decay=1e-4)
    return apply_recipe(config, recipe or "")
