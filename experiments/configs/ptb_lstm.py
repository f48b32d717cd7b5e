"""PTB word-level language modelling with a Zaremba-style LSTM and CPT (5-8 fwd / 8 bwd).

Truncated BPTT over the batchified stream (batch 20 x 35 steps, Zaremba), the LSTM
state carried from segment to segment (``carry_state``). Optimizer as PyTorch's
word_language_model (used by Wolfe & Kyrillidis for their PTB LSTM): plain SGD,
lr 20 on the mean token loss, gradient norm clipped at 0.25. Forward bits cycle
5 -> 8 (Wolfe & Kyrillidis's PTB range; 3-4 bit LSTMs diverge), errors 8 bits.

Quantized: the LSTM input and recurrent projections (``lstm_l/ih``,
``lstm_l/cell/hh``) and the ``decoder`` (Wolfe & Kyrillidis's PTB_QLSTM quantizes
its decoder, a QLinear; it is also half of the model's MACs, so keeping it fp32
would halve the saving): ``keep_full_precision=()``. The embedding is a gather
(fp32); the gates' nonlinearities and the cell update are fp32.

The defaults are a CPU budget (70-80 s of CPU, 5-6 minutes wall on the 2 shared
cores measured here): Zaremba-small widths
(200 units, 2 layers, no dropout) and 200 steps (0.15 epoch); the evaluation
scores the first ``max_eval_tokens`` predictions of each split with windows of 70
tokens, stride 35 (>= 35 tokens of context each). Zaremba-medium, the full run:

    --config.model_kwargs.embed=650 --config.model_kwargs.hidden=650 \
    --config.model_kwargs.dropout=0.5 --config.model_kwargs.init_scale=0.05 \
    --config.num_steps=51753 --config.max_eval_tokens=0   # 39 epochs of 1327 steps

    python -m experiments.train --workdir=/tmp/ptb_cpt --config=experiments/configs/ptb_lstm.py \
        --config.data_dir=../shared/datasets/ptb

Baselines: ``--config.precision.schedule=none`` (fp32), ``=constant`` (static 8/8).
PTB has no TFDS builder: ``data_dir`` (holding ``ptb.{train,valid,test}.txt``) is
required.
"""
import ml_collections

from experiments.configs import default


def get_config() -> ml_collections.ConfigDict:
    config = default.get_config()
    config.update(dataset="ptb", data_dir="", model="lstm_lm", num_steps=200, batch_size=20,
                  eval_batch_size=64, log_every=25, eval_every=0, num_devices=1)
    config.model_kwargs = ml_collections.ConfigDict(
        {"embed": 200, "hidden": 200, "num_layers": 2, "dropout": 0.0, "init_scale": 0.1})
    config.carry_state = True        # carry the LSTM state across BPTT segments (Zaremba)
    config.seq_len = 35              # training BPTT segment length (tokens)
    config.eval_seq_len = 70         # evaluation windows: 70 tokens, the last 35 scored
    config.eval_stride = 35          # tokens between evaluation windows
    config.max_eval_tokens = 8_000   # per split (0: the whole split, 73,759 / 82,429)
    config.eval_splits = ("valid", "test")  # splits evaluated
    config.precision.update(min_bits=5, max_bits=8, grad_bits=8, num_cycles=8,
                            keep_full_precision=())
    config.optimizer.update(name="sgd", learning_rate=20.0, momentum=0.0, weight_decay=0.0,
                            lr_schedule="cosine", grad_clip=0.25)
    return config
