"""Read checkpoints written by ``--export-hf`` with transformers; print one JSON object.

    python tests/scripts/hf_export_check.py DIR [DIR ...] --seq-len 32 --batch-size 8 --seed 3 --steps 0,3

For each DIR: the max abs difference between the logits of transformers' ``LlamaForCausalLM``
and of mmm's Llama loaded from DIR (``load_hf_llama``) on the same tokens, and the loss of the
transformers model on the trainer's global batch of each data step in ``--steps`` (the batch
that the trainer's step ``s + 1`` trains on), computed as the trainer computes it.
"""

import argparse
import json
import warnings

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--batch-size", type=int, required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--steps", default="0")
    args = ap.parse_args()
    from transformers import LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from mmm.data import make_dataset
    from mmm.models.llama import Llama, llama_config_from_hf, load_hf_llama

    hf_logging.disable_progress_bar()
    out = {}
    for d in args.dirs:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            theirs = LlamaForCausalLM.from_pretrained(d).float().eval()
        cfg = llama_config_from_hf(d, seq_len=args.seq_len)
        ours = Llama(cfg)
        load_hf_llama(ours, d)
        data = make_dataset("synthetic", vocab_size=cfg.vocab_size, seq_len=cfg.seq_len)
        tokens = torch.randint(0, cfg.vocab_size, (2, args.seq_len), generator=torch.Generator().manual_seed(1))
        losses = {}
        with torch.no_grad():
            a, b = ours(tokens), theirs(tokens).logits
            for step in (int(s) for s in args.steps.split(",")):
                rows = data.global_batch(args.seed, step, args.batch_size)
                logits = theirs(rows[:, :-1]).logits
                losses[step] = F.cross_entropy(logits.flatten(0, 1).float(), rows[:, 1:].flatten(0, 1)).item()
        out[d] = {
            "max_abs_diff": (a - b).abs().max().item(),
            "logits_std": b.std().item(),
            "losses": losses,
            "warnings": [str(w.message) for w in caught],
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
