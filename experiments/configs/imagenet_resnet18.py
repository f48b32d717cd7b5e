"""CPT's ImageNet recipe (Fu et al. 2021) with ResNet-18, streamed by the Grain pipeline.

Recipe: ResNet-18 (torchvision layout, `cpt_jax.models.ResNet18`), 90 epochs of the
1,281,167 ImageNet training images at batch 256 (5,004 steps per epoch, 450,360
steps), SGD momentum 0.9, lr 0.1, weight decay 1e-4; forward bits cycle 4 -> 8
(``cos_growth``, 32 cycles), errors at 8 bits; the stem conv, the 1x1 shortcut convs
and the classifier stay in full precision (CPT's ImageNet models). Inputs: random
resized 224x224 crops + flips for training, shorter side 256 + central 224x224 crop
for evaluation (`cpt_jax.data.pipeline`), ImageNet mean/std.

One deviation: the learning rate divides by 10 at 50% and 75% of the run (the
runner's ``step`` schedule: epochs 45 and 67.5) instead of the usual epochs 30 and
60, as the runner has no boundary setting.

Data: a TFDS-prepared ``imagenet2012`` directory (array_record; ``imagenette`` for a
small stand-in, 10 classes), read through ``tfds.data_source`` without TensorFlow.
Prepare it once on a machine with internet (ImageNet's tars go to
``<DIR>/downloads/manual/`` first), then point ``--config.data_dir`` at it::

    tfds build imagenet2012 --file_format=array_record --data_dir=/data/tfds
    python -m experiments.train --workdir=/tmp/imagenet \\
        --config=experiments/configs/imagenet_resnet18.py --config.data_dir=/data/tfds

Smoke test (a few steps; tests/test_input_pipelines.py runs it under
``tfds.testing.mock_data``)::

    --config.num_steps=4 --config.precision.num_cycles=2 --config.batch_size=2 \
    --config.eval_batch_size=50 --config.image_size=64
"""
import ml_collections

from experiments.configs import default

IMAGENET_TRAIN_IMAGES = 1_281_167
EPOCHS = 90
BATCH_SIZE = 256


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.update(dataset="imagenet2012", input_pipeline="grain", image_size=224,
                  model="resnet18", batch_size=BATCH_SIZE,
                  num_steps=EPOCHS * (IMAGENET_TRAIN_IMAGES // BATCH_SIZE),
                  eval_batch_size=250, augment=True, log_every=100, eval_every=5_000,
                  checkpoint_every=2_000)
    config.precision.update(min_bits=4, max_bits=8, grad_bits=8, num_cycles=32,
                            keep_full_precision=("stem_conv", "shortcut_conv",
                                                 "classifier"))
    config.optimizer.update(learning_rate=0.1, momentum=0.9, weight_decay=1e-4,
                            lr_schedule="step")
    return config
