"""CiteSeer node classification: the Cora recipe (``cora_gcn.py``) on CiteSeer.

2-layer GCN, hidden 16, dropout 0.5, Adam 0.01, weight decay 5e-4, 200 epochs
(one step = one epoch), CPT 3-8 forward / 8 backward bits with 8 cycles; both
feature transforms quantized, aggregation fp32. Kipf & Welling report 70.3% test.

    python -m experiments.train --workdir=/tmp/citeseer_cpt \
        --config=experiments/configs/citeseer_gcn.py --config.data_dir=../shared/datasets/planetoid
"""
import ml_collections

from experiments.configs import cora_gcn


def get_config() -> ml_collections.ConfigDict:
    config = cora_gcn.get_config()
    config.dataset = "citeseer"
    return config
