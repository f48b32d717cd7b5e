"""CPT's CIFAR-10 recipe (Fu et al. 2021) with a CIFAR ResNet, scaled by `num_steps`.

Full recipe: 64k steps, batch 128, SGD momentum 0.9, lr 0.1 /10 at 50% and 75%,
weight decay 1e-4 (5e-4 in some CPT scripts), 32 cycles of 3-8 forward bits, 8
backward bits; every conv quantized, the classifier kept in fp32.

    python -m experiments.train --workdir=/tmp/cifar --config=experiments/configs/cifar10_resnet.py \
        --config.data_dir=../shared/datasets/cifar10 --config.num_steps=2000

`--config.model=resnet38` / `resnet74` / `resnet110` for CPT's deeper models.
The number of cycles follows the paper's period (2000 steps) unless set.
"""
import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.update(dataset="cifar10", model="resnet20", num_steps=64_000, batch_size=128,
                  eval_batch_size=1000, augment=True, log_every=100, eval_every=2000,
                  checkpoint_every=1000)
    config.precision.num_cycles = 32
    config.optimizer.update(learning_rate=0.1, weight_decay=1e-4)
    return config
