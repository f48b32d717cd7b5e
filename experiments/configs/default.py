"""Default: CPT (cos_growth 3-8 forward / 8 backward) on scikit-learn's digits, small CNN.

Runs in about two minutes on 2 CPU cores with no download:

    python -m experiments.train --workdir=/tmp/cpt_digits --config=experiments/configs/default.py

Baselines: ``--config.precision.schedule=none`` (fp32) or ``=constant`` (static max_bits).
"""
import ml_collections

from cpt_jax.controllers import controller_fields
from cpt_jax.runner.checkpoint import DEFAULT_KEEP


def get_precision_config(**overrides) -> ml_collections.ConfigDict:
    """Precision fields shared by every config (CPT's recipe by default)."""
    p = ml_collections.ConfigDict()
    p.schedule = "cos_growth"      # a SUITE name, "constant", "critical_period" or "none"
    p.min_bits = 3                 # forward bits at the bottom of a cycle
    p.max_bits = 8                 # forward bits at the top (and of schedule="constant")
    p.num_cycles = 8               # cycles over the run (SUITE schedules)
    p.convention = "ceil"          # cycle period: ceil(T/n); floor (CPT's code); wolfe (T//n + 1)
    p.grad_bits = 8                # backward (error) bits; >= 32 keeps errors in fp32
    p.eval_bits = 0                # 0: evaluate at max_bits
    p.eval_bits_mode = "max"       # max: eval_bits (or max_bits); current: the schedule's bits
                                   # at the evaluated step (CPT, Wolfe et al.)
    p.activation_range = "batch"   # batch: each tensor's own range; running: CPT's moving
                                   # average of training ranges, used in evaluation
    p.deficit_steps = 0            # for schedule="critical_period"
    p.deficit_inclusive = False    # critical_period: low bits while t <= D (CPT's CIFAR
                                   # crit_learn.py) instead of t < D
    p.quantizer = "cpt"            # a registered preset (cpt_jax.PRESETS, cpt_jax.register_preset)
    p.compute = ""                 # what computes the products: "" (the quantizer's own; "auto"
                                   # for most: integer GEMMs where the platform runs them
                                   # faster than fp32) | auto | fake | int | fp8 | a provider
                                   # registered with cpt_jax.register_provider
    p.formats = ""                 # a schedule over formats, e.g. "nvfp4_gemm,mxfp6,mxfp8_gemm"
                                   # (PRESETS, narrow to wide): each step the widest whose
                                   # element width <= the schedule's bits; "" uses quantizer
    p.keep_full_precision = ("classifier",)   # regexes of layers kept in fp32
    p.bit_offsets = ()             # ((regex, offset), ...) per-layer bit offsets
    # Bits that answer the run's statistics (docs/adaptive.md); the schedule above is the base.
    p.controller = "none"          # a registered controller (cpt_jax.controllers.CONTROLLERS) or none
    for name, field in controller_fields().items():  # each registered controller's own fields
        p[name] = field.default    # (their help: --help, from the registry)
    p.update(overrides)
    return p


def get_optimizer_config(**overrides) -> ml_collections.ConfigDict:
    o = ml_collections.ConfigDict()
    o.name = "sgd"                 # sgd | adam | adamw
    o.learning_rate = 0.05         # peak learning rate (> 0)
    o.momentum = 0.9               # sgd: momentum in [0, 1)
    o.nesterov = False             # sgd: Nesterov momentum
    o.weight_decay = 1e-4          # L2 (sgd, adam) or decoupled (adamw) weight decay
    o.lr_schedule = "step"         # step (/10 at 50% and 75%), cosine, constant
    o.warmup_steps = 0             # linear warm-up steps before lr_schedule (< num_steps)
    o.grad_clip = 0.0              # clip the global gradient norm to this (0: no clipping)
    o.update(overrides)
    return o


def get_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    config.dataset = "digits"      # a dataset of docs/data.md: digits (embedded), mnist, cifar10, cora, ...
    config.data_dir = ""           # folder of local files or a TFDS dir ("": embedded or TFDS default)
    config.input_pipeline = "device"  # device: whole dataset on the device (small data);
                                      # grain: streamed, sharded per process (ImageNet)
    config.image_size = 224        # training/eval crop of variable-size images (ImageNet)
    config.model = "cnn"           # cnn | mlp | resnet20 | resnet38 | ... (image datasets)
    config.model_kwargs = ml_collections.ConfigDict()  # keyword arguments of the model
    config.normalize_mean = ()     # per-channel input mean (): the training set's own (CPT's CIFAR fixes it)
    config.normalize_std = ()      # per-channel input std (): the training set's own (CPT's CIFAR fixes it)
    config.num_steps = 1500        # training steps (the schedules' length)
    config.batch_size = 64         # training examples per step (all devices)
    config.eval_batch_size = 500   # examples per evaluation batch
    config.augment = False         # training augmentation (crop + flip for images)
    config.seed = 0                # initialization, data order, rounding noise
    config.log_every = 50          # steps between metrics.jsonl records (and the last)
    config.eval_every = 500        # steps between test evaluations (0: only the final one)
    config.checkpoint_every = 0    # also save every N steps to workdir/checkpoints (0: no periodic
                                   # ones); the last step and SIGTERM/SIGINT always save; a
                                   # workdir with a checkpoint resumes
    config.keep_checkpoints = DEFAULT_KEEP  # newest checkpoints kept (3)
    config.nonfinite = "skip"      # skip | ignore | stop (non-finite loss or gradients)
    config.tensorboard = True      # TensorBoard events in workdir/tensorboard
    config.plots = True            # PNGs (bits, curves) in workdir
    config.num_devices = 0         # data-parallel devices (0: all available)
    config.param_sharding = "replicate"  # replicate (data parallel) | fsdp (params, optimizer state sharded)
    config.precision = get_precision_config()
    config.optimizer = get_optimizer_config()
    return config
