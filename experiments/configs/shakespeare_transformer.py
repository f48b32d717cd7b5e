"""tiny-shakespeare character LM with a small causal Transformer and CPT (5-8 / 8).

Pre-LN Transformer (``TransformerLM``): 2 blocks, d_model 128, 4 heads, MLP 512,
dropout 0.1, learned positions, context 128 characters; AdamW lr 2e-3 (warmup 50,
cosine), weight decay 0.01, clip 1. Batches are 16 x 128 segments of the
batchified train stream. Forward bits cycle 5 -> 8 (the language setting of Wolfe
& Kyrillidis), errors 8 bits, 8 cycles.

Quantized: the query/key/value/out projections and the MLP of every block. Kept
fp32: ``lm_head`` (128 -> 65: 2% of the MACs, the output layer, as CPT keeps its
classifier); the attention score/value einsums, softmax, LayerNorm and the
embedding are not Dense ops and stay fp32.

CPU budget defaults: 200 steps (0.4M characters, 0.4 epoch), evaluation on the first
``max_eval_tokens`` characters of each split (windows of 128, stride 64).

    python -m experiments.train --workdir=/tmp/shakespeare_cpt \
        --config=experiments/configs/shakespeare_transformer.py \
        --config.data_dir=../shared/datasets/tinyshakespeare

``data_dir`` empty: TFDS ``tiny_shakespeare`` (needs the internet the first time).
"""
import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    # data_dir "": TFDS tiny_shakespeare; else the folder with input.txt
    config.update(dataset="tiny_shakespeare", model="transformer_lm", num_steps=200,
                  batch_size=16, eval_batch_size=64, log_every=25, eval_every=0)
    config.model_kwargs = ml_collections.ConfigDict(
        {"d_model": 128, "num_heads": 4, "num_layers": 2, "mlp_dim": 512, "dropout": 0.1})
    config.carry_state = False       # no recurrent state to carry across segments
    config.seq_len = 128             # training sequence length (characters)
    config.eval_seq_len = 128        # = the model's context
    config.eval_stride = 64          # each scored character sees >= 64 characters
    config.max_eval_tokens = 10_000  # per split (0: the whole split, 55,769)
    config.eval_splits = ("valid", "test")  # splits evaluated
    config.precision.update(min_bits=5, max_bits=8, grad_bits=8, num_cycles=8,
                            keep_full_precision=("lm_head",))
    config.optimizer.update(name="adamw", learning_rate=2e-3, weight_decay=0.01,
                            lr_schedule="cosine", warmup_steps=50, grad_clip=1.0)
    return config
