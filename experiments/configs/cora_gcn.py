"""Cora node classification: Kipf & Welling's 2-layer GCN with CPT (3-8 fwd / 8 bwd).

Full batch: one step is one epoch over the whole graph, so the precision schedule
advances once per epoch (as Wolfe & Kyrillidis do for GCNs). Kipf's recipe: hidden
16, dropout 0.5, Adam lr 0.01, weight decay 5e-4, 200 epochs (no early stopping
here; the decay is applied to every parameter, Kipf applies it to the first layer).
8 cycles over 200 epochs: a 25-epoch half-cosine ramp 3 -> 8 bits per cycle, the
number of cycles Wolfe & Kyrillidis use for their schedule suite.

Quantized: both feature transforms ``dense_0`` (1433 -> 16) and ``dense_1``
(16 -> 7), weights, inputs and errors, as in Wolfe & Kyrillidis's QGraphConv (every
layer's weight product low precision, the output layer included); the sparse
aggregation ``A_hat @ .`` and the biases stay fp32 (not Dense ops, nothing to keep
explicitly: ``keep_full_precision=()``).

    python -m experiments.train --workdir=/tmp/cora_cpt --config=experiments/configs/cora_gcn.py \
        --config.data_dir=../shared/datasets/planetoid

Baselines: ``--config.precision.schedule=none`` (fp32), ``=constant`` (static 8/8).
There is no TFDS builder for Planetoid: ``data_dir`` (the folder holding
``ind.cora.*``) is required.
"""
import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.update(
        dataset="cora",
        data_dir="",               # required: the Planetoid folder (no TFDS builder)
        model="gcn",               # gcn | graphsage
        num_steps=200,             # epochs (full batch: one step = one epoch)
        batch_size=1,              # unused (full batch); kept for the shared validation
        eval_batch_size=0,
        log_every=10,
        eval_every=50,
        num_devices=1)             # the graph is one batch: no data-parallel split
    config.model_kwargs = ml_collections.ConfigDict({"hidden": 16, "dropout": 0.5})
    config.precision.update(min_bits=3, max_bits=8, grad_bits=8, num_cycles=8,
                            keep_full_precision=())
    config.optimizer.update(name="adam", learning_rate=0.01, weight_decay=5e-4,
                            lr_schedule="constant")
    return config
