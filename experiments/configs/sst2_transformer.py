"""GLUE SST-2 sentiment classification, a small Transformer trained from scratch, CPT.

No pretrained weights (BERT) can be reached offline, so the encoder is trained from
scratch: 2 pre-LN blocks, d_model 128, 4 heads, MLP 256, dropout 0.1, masked mean
pooling, vocab = the 14,818 train words (lower-cased), sentences cut at 48 tokens
(every dev sentence fits). AdamW lr 1e-3 (warmup 50, cosine), weight decay 0.01,
batch 64. Forward bits 5 -> 8 with 2 cycles (Wolfe & Kyrillidis's BERT fine-tuning
setting), errors 8 bits. Quantized: every attention and MLP projection; the
``classifier`` is kept fp32 (as CPT). The reported ``test`` split is the GLUE dev
set (872 sentences; GLUE's test labels are hidden).

CPU budget defaults: 300 steps (0.29 epoch of the 67,349 train sentences).

    python -m experiments.train --workdir=/tmp/sst2_cpt --config=experiments/configs/sst2_transformer.py \
        --config.data_dir=../shared/datasets/glue/SST-2

``data_dir`` empty: TFDS ``glue/sst2`` (needs the internet the first time).
"""
import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    # data_dir "": TFDS glue/sst2; else the folder with train/dev.tsv
    config.update(dataset="sst2", model="transformer_classifier", num_steps=300, batch_size=64,
                  eval_batch_size=256, log_every=50, eval_every=0)
    config.model_kwargs = ml_collections.ConfigDict(
        {"d_model": 128, "num_heads": 4, "num_layers": 2, "mlp_dim": 256, "dropout": 0.1})
    config.max_len = 48              # tokens per sentence (longer ones truncated)
    config.vocab_size = 20000        # most frequent training words kept (others: unknown)
    config.precision.update(min_bits=5, max_bits=8, grad_bits=8, num_cycles=2,
                            keep_full_precision=("classifier",))
    config.optimizer.update(name="adamw", learning_rate=1e-3, weight_decay=0.01,
                            lr_schedule="cosine", warmup_steps=50, grad_clip=1.0)
    return config
